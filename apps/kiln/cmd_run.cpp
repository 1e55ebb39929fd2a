// apps/kiln/cmd_run.cpp: `kiln run`: prompt in, streamed text out. stdout carries only the
// generated text; stderr gets the speeds (prefill / decode tokens per second) and a hash of
// the generated ids, so two runs can be compared without diffing text.
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "apps/kiln/commands.h"
#include "apps/kiln/config_cli.h"
#include "apps/kiln/gen_common.h"
#include "core/json_depth.h"
#include "core/counters.h"
#include "core/log.h"
#include "engine/constrained.h"
#include "engine/mtp_drafter.h"
#include "engine/device_probe.h"
#include "engine/dflash_drafter.h"
#include "engine/scheduler.h"
#include "engine/speculative.h"
#include "grammar/json_schema.h"
#include "sampling/sampler.h"

namespace kiln::app {
namespace {

struct RunOptions {
  std::string model, prompt, prompt_file;
  int32_t n_predict = 128;
  int32_t n_ctx = 0;  // 0: min(training context, 4096)
  SamplerParams sampling;
  std::vector<std::string> logit_bias;  // "ID+BIAS" / "ID-BIAS" / "ID=-inf"
  std::shared_ptr<ConfigOverrides> config;
  std::string draft;        // --draft MODEL: speculative decoding with a draft model
  bool spec_ngram = false;  // --spec-ngram: speculative decoding with prompt lookup
  bool spec_mtp = false;    // --spec-mtp: speculative decoding with the model's NextN layer
  std::string dflash;       // --dflash DRAFTER: speculative decoding with a DFlash block drafter
  std::string spec_trace;   // --spec-trace FILE: JSON of the ids and every draft/verify step
  bool cuda_trace = false;  // --cuda-trace: a speculative run once more under CUPTI
  // --draft-n: tokens drafted per verify step; -1: 4 with a drafter, and for a grammar up to
  // GenerationParams::kMaxDraft forced tokens (0 there: none).
  int32_t draft_n = -1;
  int64_t seed = 42;  // -1: drawn from std::random_device
  // Constrained decoding (llama.cpp's spellings): GBNF text, a GBNF file, a JSON Schema.
  std::string grammar, grammar_file, json_schema;
};

// The run's grammar from --grammar / --grammar-file / --json-schema; null when none is given.
Expected<std::shared_ptr<const grammar::Grammar>> run_grammar(const RunOptions& o) {
  const int given = !o.grammar.empty() + !o.grammar_file.empty() + !o.json_schema.empty();
  if (given == 0) return std::shared_ptr<const grammar::Grammar>();
  if (given > 1) return Status::error("give one of --grammar, --grammar-file, --json-schema");
  std::string gbnf = o.grammar;
  if (!o.grammar_file.empty()) {
    std::FILE* f = std::fopen(o.grammar_file.c_str(), "rb");
    if (!f) return Status::errorf("cannot read grammar file '{}'", o.grammar_file);
    char buf[65536];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) gbnf.append(buf, n);
    std::fclose(f);
  }
  if (!o.json_schema.empty()) {
    if (json_nesting_depth(o.json_schema) > kMaxJsonDepth)
      return Status::errorf("--json-schema is {}", kJsonTooDeep);
    auto j = nlohmann::ordered_json::parse(o.json_schema, nullptr, false);
    if (j.is_discarded()) return Status::error("--json-schema is not valid JSON");
    KILN_ASSIGN_OR_RETURN(gbnf, grammar::json_schema_to_gbnf(j));
  }
  return grammar::Grammar::parse(gbnf);
}

// After the generated text: the stats lines on stderr must start on a line of their own where
// a person sees both streams together (a terminal, or 2>&1 into one file), while stdout piped
// elsewhere stays exactly the generated text.
void end_text_output() {
  std::fflush(stdout);
  struct stat out {
  }, err{};
  if (::isatty(::fileno(stdout))) {
    std::fputc('\n', stdout);
  } else if (::fstat(::fileno(stdout), &out) == 0 && ::fstat(::fileno(stderr), &err) == 0 &&
             out.st_dev == err.st_dev && out.st_ino == err.st_ino) {
    std::fputc('\n', stderr);
  }
  std::fflush(stdout);
}

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

Status parse_logit_bias(const std::vector<std::string>& specs,
                        std::vector<std::pair<int32_t, float>>& out) {
  for (const std::string& s : specs) {
    // llama.cpp's spelling: TOKEN_ID(+/-)BIAS, e.g. 15043+1 or 15043-inf.
    size_t at = s.find_first_of("+-=", 1);
    if (at == std::string::npos)
      return Status::errorf("--logit-bias '{}': expected ID+BIAS or ID-BIAS", s);
    try {
      size_t used = 0;
      const int id = std::stoi(s.substr(0, at), &used);
      if (used != at) throw std::invalid_argument("id");
      std::string b = s.substr(at + (s[at] == '=' ? 1 : 0));
      float bias;
      if (b == "-inf")
        bias = -INFINITY;
      else if (b == "+inf")
        bias = INFINITY;
      else {
        bias = std::stof(b, &used);
        if (used != b.size()) throw std::invalid_argument("bias");
      }
      out.emplace_back(id, bias);
    } catch (const std::exception&) {
      return Status::errorf("--logit-bias '{}': expected ID+BIAS or ID-BIAS", s);
    }
  }
  return Status::ok();
}

// Speculative path of `kiln run` (issue 10): same output contract (greedy ids identical to
// plain decoding; sampled ids distributed as plain sampling), plus acceptance figures.
Status run_speculative(RunOptions o, const Config& cfg, Runtime& rt,
                       std::span<const int32_t> prompt, int32_t n_ctx) {
  const Tokenizer& tok = rt.tokenizer();
  if (o.draft_n == -1) o.draft_n = 4;
  if (o.draft_n < 1 || o.draft_n > 64)
    return Status::errorf("--draft-n {} outside [1, 64]", o.draft_n);
  Session session(rt.model(), rt.backend(), n_ctx);
  std::unique_ptr<Drafter> drafter;
  if (o.spec_mtp) {
    KILN_ASSIGN_OR_RETURN(drafter, MtpDrafter::create(rt.model(), rt.backend(), n_ctx));
  } else if (!o.draft.empty()) {
    KILN_ASSIGN_OR_RETURN(auto dm, Model::load(o.draft));
    KILN_ASSIGN_OR_RETURN(drafter,
                          ModelDrafter::create(dm, rt.backend(), n_ctx, rt.model()->n_vocab()));
  } else if (!o.dflash.empty()) {
    KILN_ASSIGN_OR_RETURN(auto dd, DflashDrafter::create(o.dflash, rt.model(), rt.backend(), n_ctx,
                                                         session.max_batch()));
    if (o.draft_n > dd->max_draft())
      return Status::errorf("--draft-n {} exceeds the DFlash drafter's block ({} drafts at most)",
                            o.draft_n, dd->max_draft());
    drafter = std::move(dd);
  } else {
    drafter = std::make_unique<NgramDrafter>(1, 3);
  }
  SpecParams sp;
  sp.n_draft = o.draft_n;
  sp.sampling = o.sampling;
  sp.draft_sampling = o.sampling;
  KILN_ASSIGN_OR_RETURN(auto dec, SpeculativeDecoder::create(session, *drafter, sp));
  const auto t_prefill = Clock::now();
  KILN_TRY(dec->start(prompt));
  const double prefill_s = seconds_since(t_prefill);

  std::vector<int32_t> out_ids;
  Utf8Stream stream;
  bool stopped_by_eog = false;
  nlohmann::ordered_json trace_steps = nlohmann::ordered_json::array();
  const auto t_decode = Clock::now();
  while (!stopped_by_eog && static_cast<int32_t>(out_ids.size()) < o.n_predict) {
    KILN_ASSIGN_OR_RETURN(SpecStep st, dec->step());
    if (!o.spec_trace.empty())
      trace_steps.push_back(
          {{"n_past", st.n_past}, {"draft", st.draft}, {"n_accepted", st.n_accepted}});
    for (int32_t id : st.tokens) {
      out_ids.push_back(id);
      if (tok.is_eog(id)) {
        stopped_by_eog = true;
        break;
      }
      const std::string text = stream.push(tok.token_to_piece(id, /*special=*/false));
      if (!text.empty()) {
        std::fwrite(text.data(), 1, text.size(), stdout);
        std::fflush(stdout);
      }
      if (static_cast<int32_t>(out_ids.size()) == o.n_predict) break;
    }
  }
  const std::string rest = stream.flush();
  std::fwrite(rest.data(), 1, rest.size(), stdout);
  end_text_output();
  const double decode_s = seconds_since(t_decode);
  const SpecStats& s = dec->stats();
  fmt::print(stderr,
             "kiln run: prompt {} tokens, prefill {:.2f} t/s ({:.1f} ms); generated {} tokens{}, "
             "decode {:.2f} t/s ({:.1f} ms)\n",
             prompt.size(), double(prompt.size()) / prefill_s, prefill_s * 1e3, out_ids.size(),
             stopped_by_eog ? " (end of generation)" : "",
             decode_s > 0 ? double(out_ids.size()) / decode_s : 0.0, decode_s * 1e3);
  fmt::print(
      stderr,
      "kiln run: speculative ({}, k={}): {} verify steps, drafted {}, accepted {} ({:.1f}%), "
      "{:.2f} tokens/step, draft {:.1f} ms, verify {:.1f} ms\n",
      drafter->name(), o.draft_n, s.steps, s.drafted, s.accepted,
      s.drafted ? 100.0 * double(s.accepted) / double(s.drafted) : 0.0, s.tokens_per_step(),
      s.draft_s * 1e3, s.verify_s * 1e3);
  fmt::print(stderr, "kiln run: ids xxh64 {}\n", hash_ids(out_ids));
  if (cfg.stats) {
    fmt::print(stderr, "stats: config\n{}", describe(cfg));
    const auto counters = process_counters().snapshot();
    if (!counters.empty()) fmt::print(stderr, "stats: counters\n{}", format_counters(counters));
    fmt::print(stderr, "{}", moe::format_store_stats());
  }
  if (o.cuda_trace) {
    // The same generation again (start() resets both sides; greedy or seeded: the same steps),
    // its kernels per verify step.
    ProbePass pass;
    pass.test = fmt::format("speculative ({}, k={}) verify step", drafter->name(), o.draft_n);
    pass.steps = double(s.steps);
    pass.decode = true;
    pass.step_us = s.steps ? decode_s * 1e6 / double(s.steps) : 0;
    const size_t n_ids = out_ids.size();
    pass.run = [&]() -> Expected<double> {
      const auto t0 = Clock::now();
      KILN_TRY(dec->start(prompt));
      size_t n = 0;
      while (n < n_ids) {
        KILN_ASSIGN_OR_RETURN(SpecStep st, dec->step());
        n += st.tokens.size();
      }
      return double(n) / seconds_since(t0);
    };
    KILN_ASSIGN_OR_RETURN(std::string table, trace_pass(rt.backend(), pass));
    fmt::print(stderr, "{}", table);
  }
  if (!o.spec_trace.empty()) {
    // ids: every generated id (the last step's tail past -n included is cut, as printed).
    const nlohmann::ordered_json trace = {{"mode", drafter->name()},
                                          {"n_draft", o.draft_n},
                                          {"prompt_tokens", prompt.size()},
                                          {"ids", out_ids},
                                          {"steps", std::move(trace_steps)}};
    std::FILE* f = std::fopen(o.spec_trace.c_str(), "wb");
    if (!f) return Status::errorf("cannot write --spec-trace file '{}'", o.spec_trace);
    const std::string text = trace.dump(1) + "\n";
    const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
    if (std::fclose(f) != 0 || !ok)
      return Status::errorf("cannot write --spec-trace file '{}'", o.spec_trace);
  }
  return Status::ok();
}

Status run(RunOptions o) {
  KILN_ASSIGN_OR_RETURN(Config cfg, load_config(*o.config));
  if (auto lvl = parse_log_level(cfg.log_level)) set_log_level(*lvl);
  if (!o.prompt_file.empty()) {
    if (!o.prompt.empty()) return Status::error("give either -p PROMPT or -f FILE, not both");
    const bool from_stdin = o.prompt_file == "-";
    std::FILE* f = from_stdin ? stdin : std::fopen(o.prompt_file.c_str(), "rb");
    if (!f) return Status::errorf("cannot read prompt file '{}'", o.prompt_file);
    char buf[65536];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) o.prompt.append(buf, n);
    if (!from_stdin) std::fclose(f);
  }
  if (o.prompt.empty()) return Status::error("empty prompt (give -p PROMPT or -f FILE)");
  if (size_t bad = invalid_utf8_offset(o.prompt); bad != std::string::npos)
    return Status::errorf("prompt is not valid UTF-8 (byte {} = 0x{:02x})", bad,
                          static_cast<unsigned char>(o.prompt[bad]));
  if (o.n_predict == 0 || o.n_predict < -1)
    return Status::errorf("-n {} must be > 0, or -1 (until the end)", o.n_predict);
  if (o.seed < -1) return Status::errorf("--seed {} must be >= 0, or -1 (random)", o.seed);
  if (o.seed == -1) {
    o.sampling.seed = (uint64_t(std::random_device{}()) << 32) | std::random_device{}();
    fmt::print(stderr, "kiln run: seed {}\n", o.sampling.seed);
  } else {
    o.sampling.seed = static_cast<uint64_t>(o.seed);
  }
  if (o.n_ctx < 0) return Status::errorf("-c {} must be >= 0", o.n_ctx);
  KILN_TRY(parse_logit_bias(o.logit_bias, o.sampling.logit_bias));

  KILN_ASSIGN_OR_RETURN(std::string path, resolve_model_path(o.model, cfg));
  KILN_ASSIGN_OR_RETURN(const EngineOptions eo, engine_options(cfg));
  KILN_ASSIGN_OR_RETURN(Runtime rt, Runtime::open(path, eo));
  const Tokenizer& tok = rt.tokenizer();
  const int32_t n_ctx = o.n_ctx > 0 ? o.n_ctx : std::min(rt.model()->n_ctx_train(), 4096);

  const std::vector<int32_t> prompt = tok.encode(o.prompt, /*add_special=*/true, false);
  if (prompt.empty()) return Status::error("the prompt tokenized to nothing");
  if (int64_t(prompt.size()) > n_ctx)
    return Status::errorf("prompt of {} tokens does not fit the context of {} (-c)", prompt.size(),
                          n_ctx);
  if (o.n_predict == -1) {  // llama.cpp's -n -1: until the end of generation or of the context
    if (int64_t(prompt.size()) >= n_ctx)
      return Status::errorf("prompt of {} tokens leaves no room in the context of {} (-c)",
                            prompt.size(), n_ctx);
    o.n_predict = n_ctx - static_cast<int32_t>(prompt.size());
  }
  if (int64_t(prompt.size()) + o.n_predict > n_ctx)
    return Status::errorf(
        "-n {} with a prompt of {} tokens exceeds the context of {} (-c); "
        "at most -n {}",
        o.n_predict, prompt.size(), n_ctx, n_ctx - int64_t(prompt.size()));
  KILN_ASSIGN_OR_RETURN(Sampler sampler, Sampler::create(o.sampling, rt.model()->n_vocab()));
  for (int32_t id : prompt) sampler.accept(id);

  KILN_ASSIGN_OR_RETURN(auto grammar, run_grammar(o));
  const int spec_modes = !o.draft.empty() + o.spec_ngram + !o.dflash.empty() + o.spec_mtp;
  if (spec_modes > 1)
    return Status::error("give one of --draft, --spec-ngram, --dflash and --spec-mtp");
  if (spec_modes == 0 && !o.spec_trace.empty())
    return Status::error(
        "--spec-trace needs speculative decoding (--draft, --spec-ngram, --dflash, --spec-mtp)");
  if (spec_modes == 0 && o.cuda_trace)
    return Status::error(
        "--cuda-trace in kiln run traces speculative decoding (--draft, --spec-ngram, --dflash, "
        "--spec-mtp); plain decoding: kiln bench --cuda-trace");
  if (grammar && spec_modes > 0)
    return Status::error("--grammar/--json-schema with speculative decoding is not supported");
  if (spec_modes > 0) return run_speculative(o, cfg, rt, prompt, n_ctx);
  std::optional<Constraint> constraint;
  if (grammar)
    constraint.emplace(Constraint{make_token_trie(tok), grammar::Matcher(grammar), {}, {}, {}});
  if (o.draft_n < -1 || o.draft_n > 64)
    return Status::errorf("--draft-n {} outside [0, 64]", o.draft_n);
  // The bytes a grammar forces (a JSON key, the text between two fields) are drafted as tokens
  // and verified in one forward pass, as in `kiln serve` (verify_forced): same ids.
  const int32_t max_forced = !constraint     ? 0
                             : o.draft_n < 0 ? GenerationParams::kMaxDraft
                                             : o.draft_n;

  Session session(rt.model(), rt.backend(), n_ctx);
  // Greedy or plain top-k sampling needs only each step's best candidates (--device-sampling):
  // a GPU then downloads k values per token instead of the vocabulary. Same ids.
  const int32_t k_top =
      eo.device_sampling && !constraint ? sampler.candidates_needed(Backend::kTopKMost) : 0;
  std::span<const float> logits;
  Session::TopK top;
  auto eval = [&](std::span<const int32_t> toks) -> Status {
    if (k_top > 0) {
      KILN_ASSIGN_OR_RETURN(top, session.eval_top_k(toks, k_top));
    } else {
      KILN_ASSIGN_OR_RETURN(logits, session.eval(toks, false));
    }
    return Status::ok();
  };
  const auto t_prefill = Clock::now();
  KILN_ASSIGN_OR_RETURN(const std::span<const int32_t> prompt_rest, session.prefill_head(prompt));
  KILN_TRY(eval(prompt_rest));
  const double prefill_s = seconds_since(t_prefill);

  std::vector<int32_t> out_ids;
  Utf8Stream stream;
  bool stopped_by_eog = false;
  // Records a sampled token and prints it; false when the run ends with it.
  auto emit = [&](int32_t id) -> bool {
    sampler.accept(id);
    out_ids.push_back(id);
    if (tok.is_eog(id)) {
      stopped_by_eog = true;
      return false;
    }
    // The grammar complete with nothing allowed after it ends the run like end of text.
    const bool complete = constraint && constraint->accept(id);
    const std::string text = stream.push(tok.token_to_piece(id, /*special=*/false));
    if (!text.empty()) {
      std::fwrite(text.data(), 1, text.size(), stdout);
      std::fflush(stdout);
    }
    if (complete) {
      stopped_by_eog = true;  // no forward pass follows, as after end of generation
      return false;
    }
    return int32_t(out_ids.size()) < o.n_predict;  // the last token needs no forward pass
  };
  auto sample = [&](std::span<const float> row) {
    return constraint  ? constraint->sample(sampler, row)
           : k_top > 0 ? sampler.sample_top(top.ids, top.logits)
                       : sampler.sample(row);
  };
  const Status dead_end = Status::error("grammar: no token of the vocabulary continues the output");
  // --stats splits the decode time at this many forward passes: the first steps of a process
  // pay for first touches (weights paged in, streamed experts loaded, graphs captured), the
  // rest are the steady state; one run then gives the cold and the warm rate.
  constexpr int32_t kColdSteps = 8;
  double cold_s = -1;
  size_t cold_tokens = 0;
  uint64_t n_passes = 0, forced_steps = 0, forced_drafted = 0, forced_accepted = 0;
  std::vector<int32_t> step_in;
  const auto t_decode = Clock::now();
  int32_t id = sample(logits);
  if (id < 0) return dead_end;
  for (bool more = emit(id); more;) {
    std::vector<int32_t> drafts;
    const int64_t k =
        std::min<int64_t>({max_forced, session.max_batch() - 1, n_ctx - session.n_pos() - 1,
                           o.n_predict - int64_t(out_ids.size()) - 1});
    if (k > 0) drafts = constraint->forced(static_cast<size_t>(k));
    step_in.assign(1, id);
    step_in.insert(step_in.end(), drafts.begin(), drafts.end());
    const int32_t base = session.n_pos();
    if (drafts.empty()) {
      KILN_TRY(eval(step_in));
      id = sample(logits);
      if (id < 0) return dead_end;
      more = emit(id);
    } else {
      KILN_ASSIGN_OR_RETURN(auto rows, session.eval(step_in, /*all_logits=*/true));
      const ForcedVerdict v =
          verify_forced(*constraint, sampler, rows, drafts, [&](int32_t t, std::span<const float>) {
            id = t;
            return more = emit(t);
          });
      if (v.n_accepted < int32_t(drafts.size()))
        KILN_TRY(session.rollback(base + 1 + v.n_accepted));
      ++forced_steps;
      forced_drafted += drafts.size();
      forced_accepted += static_cast<uint64_t>(v.n_accepted);
      if (v.dead_end) return dead_end;
    }
    if (++n_passes == kColdSteps) {
      cold_s = seconds_since(t_decode);
      cold_tokens = out_ids.size();
    }
  }
  const std::string rest = stream.flush();
  std::fwrite(rest.data(), 1, rest.size(), stdout);
  end_text_output();
  const double decode_s = seconds_since(t_decode);

  // Decode speed counts the tokens forward passes ran: every sampled token but the last.
  const size_t n_decode_evals = out_ids.empty() ? 0 : out_ids.size() - (stopped_by_eog ? 0 : 1);
  fmt::print(stderr,
             "kiln run: prompt {} tokens, prefill {:.2f} t/s ({:.1f} ms); generated {} tokens{}, "
             "decode {:.2f} t/s ({:.1f} ms)\n",
             prompt.size(), double(prompt.size()) / prefill_s, prefill_s * 1e3, out_ids.size(),
             stopped_by_eog ? " (end of generation)" : "",
             n_decode_evals ? double(n_decode_evals) / decode_s : 0.0, decode_s * 1e3);
  if (constraint)
    fmt::print(stderr,
               "kiln run: grammar: {} decode passes; forced tokens: {} verify steps, drafted {}, "
               "accepted {}\n",
               n_passes, forced_steps, forced_drafted, forced_accepted);
  fmt::print(stderr, "kiln run: ids xxh64 {}\n", hash_ids(out_ids));
  if (cfg.stats) {
    const MemoryUse mem = memory_use();
    fmt::print(stderr,
               "stats: model {} ({}), {:.1f} MiB of weights, load {:.1f} ms, backend {}\n"
               "stats: context {} positions, KV cache {:.2f} MiB ({} bytes per token)\n"
               "stats: RSS {:.1f} MiB (file-backed {:.1f} MiB, anonymous {:.1f} MiB)\n",
               path, rt.model()->arch_name(), double(rt.model()->weight_bytes()) / (1 << 20),
               rt.load_seconds() * 1e3, rt.backend().name(), n_ctx,
               double(session.kv_bytes()) / (1 << 20), session.kv_bytes_per_token(),
               double(mem.rss) / (1 << 20), double(mem.rss_file) / (1 << 20),
               double(mem.rss_anon) / (1 << 20));
    if (cold_s > 0 && n_passes > uint64_t(kColdSteps))
      fmt::print(stderr, "stats: decode steps 1-{}: {:.2f} t/s, steps {}-{}: {:.2f} t/s\n",
                 kColdSteps, double(cold_tokens) / cold_s, kColdSteps + 1, n_passes,
                 double(n_decode_evals - cold_tokens) / (decode_s - cold_s));
    fmt::print(stderr, "stats: config\n{}", describe(cfg));
    const auto counters = process_counters().snapshot();
    if (!counters.empty()) fmt::print(stderr, "stats: counters\n{}", format_counters(counters));
    fmt::print(stderr, "{}", moe::format_store_stats());
  }
  return Status::ok();
}

}  // namespace

void add_run_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("run", "generate text from a prompt");
  auto o = std::make_shared<RunOptions>();
  cmd->add_option("-m,--model", o->model, "GGUF model (default: the demo model stories260K)");
  cmd->add_option("-p,--prompt", o->prompt, "prompt text");
  cmd->add_option("-f,--file", o->prompt_file, "read the prompt from a file (- : standard input)");
  cmd->add_option("-n,--n-predict", o->n_predict,
                  "tokens to generate (default 128; -1: until the end of generation or of the "
                  "context)");
  cmd->add_option("-c,--ctx-size", o->n_ctx, "context size (default min(training, 4096))");
  add_sampling_options(cmd, o->sampling);
  cmd->add_option("--logit-bias", o->logit_bias, "ID+BIAS or ID-BIAS (repeatable; -inf bans)");
  cmd->add_option("-s,--seed", o->seed, "sampling seed (default 42; -1: a random one, printed)");
  cmd->add_option("--draft", o->draft,
                  "speculative decoding with this draft model (same vocabulary)");
  cmd->add_flag("--spec-ngram", o->spec_ngram, "speculative decoding with n-gram prompt lookup");
  cmd->add_flag("--spec-mtp", o->spec_mtp,
                "speculative decoding with the model's own NextN (MTP) layer as the drafter");
  cmd->add_option("--dflash", o->dflash,
                  "speculative decoding with this DFlash block drafter (GGUF arch 'dflash')");
  cmd->add_option("--spec-trace", o->spec_trace,
                  "write the speculative run as JSON: ids and per step n_past, draft, n_accepted");
  cmd->add_flag("--cuda-trace", o->cuda_trace,
                "CUDA, speculative runs: the generation once more under CUPTI's kernel records, "
                "printed per verify step with the GPU's idle time");
  cmd->add_option("--grammar", o->grammar, "constrain the output to a GBNF grammar (text)");
  cmd->add_option("--grammar-file", o->grammar_file, "constrain the output to a GBNF file");
  cmd->add_option("-j,--json-schema", o->json_schema,
                  "constrain the output to JSON valid against this JSON Schema");
  cmd->add_option("--draft-n", o->draft_n,
                  "tokens drafted per verify step (default 4; with a grammar, up to 8 forced "
                  "tokens, 0: none)");
  o->config = add_config_options(cmd);
  cmd->callback([o, &exit_code] {
    if (Status s = run(*o); !s) {
      std::fflush(stdout);
      fmt::print(stderr, "kiln run: {}\n", s.message());
      exit_code = 1;
    }
  });
}

}  // namespace kiln::app
