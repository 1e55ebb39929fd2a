// apps/kiln/cmd_perplexity.cpp: `kiln perplexity`: llama-perplexity's convention, so the
// figures compare directly: the text is tokenized once (BOS added), cut into chunks of n_ctx
// tokens, each chunk evaluated from an empty cache with its first token replaced by BOS, and
// only the second half of each chunk scored (those predictions see at least n_ctx/2 tokens).
#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "apps/kiln/commands.h"
#include "apps/kiln/config_cli.h"
#include "apps/kiln/gen_common.h"
#include "core/log.h"

namespace kiln::app {
namespace {

struct PplOptions {
  std::string model, text_file;
  int32_t n_ctx = 512;
  int32_t max_chunks = 0;  // 0: all
  std::shared_ptr<ConfigOverrides> config;
};

// -log softmax(logits)[target], in double so long vocabularies do not lose digits.
double nll(std::span<const float> logits, int32_t target) {
  float mx = logits[0];
  for (float x : logits) mx = std::max(mx, x);
  double sum = 0;
  for (float x : logits) sum += std::exp(double(x) - mx);
  return std::log(sum) - (double(logits[size_t(target)]) - mx);
}

Status run(const PplOptions& o) {
  KILN_ASSIGN_OR_RETURN(Config cfg, load_config(*o.config));
  if (auto lvl = parse_log_level(cfg.log_level)) set_log_level(*lvl);
  if (o.n_ctx < 4) return Status::errorf("-c {} too small (at least 4)", o.n_ctx);
  std::FILE* f = std::fopen(o.text_file.c_str(), "rb");
  if (!f) return Status::errorf("cannot read text file '{}'", o.text_file);
  std::string text;
  char buf[65536];
  size_t got;
  while ((got = std::fread(buf, 1, sizeof buf, f)) > 0) text.append(buf, got);
  std::fclose(f);

  KILN_ASSIGN_OR_RETURN(std::string path, resolve_model_path(o.model, cfg));
  KILN_ASSIGN_OR_RETURN(const EngineOptions eo, engine_options(cfg));
  KILN_ASSIGN_OR_RETURN(Runtime rt, Runtime::open(path, eo));
  const Tokenizer& tok = rt.tokenizer();
  const std::vector<int32_t> tokens = tok.encode(text, /*add_special=*/true, false);
  const int32_t n_ctx = o.n_ctx;
  if (int64_t(tokens.size()) < 2 * int64_t(n_ctx))
    return Status::errorf("the text has {} tokens; perplexity with -c {} needs at least {}",
                          tokens.size(), n_ctx, 2 * int64_t(n_ctx));
  int64_t n_chunk = int64_t(tokens.size()) / n_ctx;
  if (o.max_chunks > 0) n_chunk = std::min<int64_t>(n_chunk, o.max_chunks);
  const int32_t bos = tok.bos();
  const bool add_bos = tok.add_bos() && bos != kTokenNull;
  const int32_t first = n_ctx / 2;
  const int32_t n_vocab = rt.model()->n_vocab();

  fmt::print(stderr, "kiln perplexity: {} tokens, {} chunks of {}, scoring positions {}..{}\n",
             tokens.size(), n_chunk, n_ctx, first, n_ctx - 2);
  Session session(rt.model(), rt.backend(), n_ctx);
  double sum = 0, sum2 = 0;
  int64_t count = 0;
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<int32_t> chunk(static_cast<size_t>(n_ctx));
  for (int64_t c = 0; c < n_chunk; ++c) {
    const auto begin = tokens.begin() + c * n_ctx;
    std::copy(begin, begin + n_ctx, chunk.begin());
    if (add_bos) chunk[0] = bos;
    KILN_TRY(session.rollback(0));
    KILN_ASSIGN_OR_RETURN(std::span<const float> logits, session.eval(chunk, true));
    // Row j predicts the chunk's token j + 1 (the original token, never the BOS swap).
    for (int32_t j = first; j < n_ctx - 1; ++j) {
      const double v = nll(logits.subspan(size_t(j) * size_t(n_vocab), size_t(n_vocab)),
                           tokens[size_t(c * n_ctx + j + 1)]);
      sum += v;
      sum2 += v * v;
      ++count;
    }
    fmt::print("[{}] {:.4f}\n", c + 1, std::exp(sum / double(count)));
    std::fflush(stdout);
  }
  const double mean = sum / double(count);
  const double ppl = std::exp(mean);
  // Standard error of the mean NLL, carried to PPL (as llama-perplexity reports it).
  const double var = count > 1 ? (sum2 / double(count) - mean * mean) / double(count - 1) : 0;
  const double err = ppl * std::sqrt(std::max(0.0, var));
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  fmt::print("Final estimate: PPL = {:.4f} +/- {:.5f}\n", ppl, err);
  fmt::print(stderr, "kiln perplexity: {} scored tokens, {:.2f} s ({:.1f} t/s evaluated)\n", count,
             secs, double(n_chunk * n_ctx) / secs);
  return Status::ok();
}

}  // namespace

void add_perplexity_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("perplexity", "perplexity of a text, llama.cpp's convention");
  auto o = std::make_shared<PplOptions>();
  cmd->add_option("-m,--model", o->model, "GGUF model (default: the demo model stories260K)");
  cmd->add_option("-f,--file", o->text_file, "text file")->required();
  cmd->add_option("-c,--ctx-size", o->n_ctx, "chunk size in tokens (default 512)");
  cmd->add_option("--chunks", o->max_chunks, "evaluate at most this many chunks (0: all)");
  o->config = add_config_options(cmd);
  cmd->callback([o, &exit_code] {
    if (Status s = run(*o); !s) {
      std::fflush(stdout);
      fmt::print(stderr, "kiln perplexity: {}\n", s.message());
      exit_code = 1;
    }
  });
}

}  // namespace kiln::app
