// apps/kiln/cmd_logits.cpp: `kiln logits`: tokenizes a prompt file as llama.cpp does, runs
// one batched prefill with logits at every position and N greedy single-token decode steps,
// and prints JSON with the golden files' fields so results can be diffed against llama.cpp.
#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "apps/kiln/commands.h"
#include "engine/runtime.h"
#include "engine/session.h"
#include "model/reference.h"
#include "tokenizer/tokenizer.h"

namespace kiln::app {
namespace {

struct LogitsOptions {
  std::string model;
  std::string prompt_file;
  int n_predict = 32;
  std::string device = "cpu";
  int threads = 0;
  int n_ctx = 0;
  int top_k = 10;
};

// Indices of the k largest values, largest first (ties: lower id first, as llama.cpp's sort).
std::vector<int32_t> top_ids(std::span<const float> x, int k) {
  std::vector<int32_t> ids(x.size());
  std::iota(ids.begin(), ids.end(), 0);
  k = std::min<int>(k, static_cast<int>(ids.size()));
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(),
                    [&](int32_t a, int32_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); });
  ids.resize(static_cast<size_t>(k));
  return ids;
}

int run_logits(const LogitsOptions& o) {
  auto fail = [](const std::string& msg) {
    fmt::print(stderr, "kiln logits: {}\n", msg);
    return 1;
  };
  std::ifstream f(o.prompt_file, std::ios::binary);
  if (!f) return fail(fmt::format("cannot read prompt file '{}'", o.prompt_file));
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string text = ss.str();
  if (o.n_predict < 0) return fail(fmt::format("-n {} must be >= 0", o.n_predict));
  if (o.top_k < 1) return fail("--top-k must be >= 1");

  auto model = Model::load(o.model);
  if (!model) return fail(model.error());
  auto tok = Tokenizer::from_gguf((*model)->gguf());
  if (!tok) return fail(fmt::format("tokenizer: {}", tok.error()));
  const std::vector<int32_t> prompt =
      tok->encode(text, /*add_special=*/true, /*parse_special=*/false);
  if (prompt.empty()) return fail("the prompt has no tokens");
  const int32_t n_ctx = o.n_ctx > 0 ? o.n_ctx : (*model)->n_ctx_train();
  if (static_cast<int64_t>(prompt.size()) + o.n_predict > n_ctx)
    return fail(fmt::format("prompt ({} tokens) + -n {} exceeds the context ({})", prompt.size(),
                            o.n_predict, n_ctx));

  // One evaluator interface over the fast session and the reference pass.
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Session> session;
  std::unique_ptr<model::ReferenceSession> reference;
  if (o.device == "cpu") {
    EngineOptions eo;
    eo.device = Device::Cpu;
    eo.threads = o.threads;
    auto be = Runtime::make_backend(**model, eo);
    if (!be) return fail(be.error());
    backend = std::move(*be);
  } else if (o.device == "ref")
    backend = Runtime::make_reference_backend();
  else if (o.device != "reference")
    return fail(fmt::format("unknown --device '{}' (cpu, ref, reference)", o.device));
  if (backend)
    session = std::make_unique<Session>(*model, *backend, n_ctx);
  else
    reference =
        std::make_unique<model::ReferenceSession>((*model)->hparams(), (*model)->weights(), n_ctx);
  auto eval = [&](std::span<const int32_t> t, bool all) {
    return session ? session->eval(t, all) : reference->eval(t, all);
  };

  const size_t V = static_cast<size_t>((*model)->n_vocab());
  auto logits = eval(prompt, true);
  if (!logits) return fail(logits.error());
  nlohmann::json out;
  out["model"] = o.model;
  out["n_vocab"] = V;
  out["prompt"] = text;
  out["prompt_tokens"] = prompt;
  nlohmann::json tops = nlohmann::json::array();
  for (size_t p = 0; p < prompt.size(); ++p) {
    const auto row = logits->subspan(p * V, V);
    std::vector<float> vals;
    const std::vector<int32_t> ids = top_ids(row, o.top_k);
    for (int32_t id : ids) vals.push_back(row[id]);
    tops.push_back({{"pos", p}, {"ids", ids}, {"logits", vals}});
  }
  out["prompt_top"] = std::move(tops);

  std::vector<int32_t> greedy;
  std::vector<float> margins;
  std::string greedy_text;
  std::vector<float> last(logits->end() - static_cast<ptrdiff_t>(V), logits->end());
  for (int i = 0; i < o.n_predict; ++i) {
    const std::vector<int32_t> best = top_ids(last, 2);
    greedy.push_back(best[0]);
    margins.push_back(best.size() > 1 ? last[best[0]] - last[best[1]] : 0.0f);
    greedy_text += tok->token_to_piece(best[0]);
    if (i + 1 == o.n_predict) break;
    auto step = eval(std::span<const int32_t>(&greedy.back(), 1), false);
    if (!step) return fail(step.error());
    last.assign(step->begin(), step->end());
  }
  out["greedy"] = greedy;
  out["greedy_margins"] = margins;
  out["greedy_text"] = greedy_text;
  out["producer"] = fmt::format("kiln logits, device {}{}", o.device,
                                backend ? fmt::format(" ({})", backend->name()) : std::string());
  // Invalid UTF-8 in pieces (byte tokens) must not abort the dump: replace it.
  fmt::print("{}\n", out.dump(1, ' ', false, nlohmann::json::error_handler_t::replace));
  return 0;
}

}  // namespace

void add_logits_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand(
      "logits", "prompt logits (batched prefill) and greedy decode steps as golden-style JSON");
  auto o = std::make_shared<LogitsOptions>();
  cmd->add_option("-m,--model", o->model, "GGUF model")->required();
  cmd->add_option("-f,--file", o->prompt_file, "prompt text file")->required();
  cmd->add_option("-n,--n-predict", o->n_predict, "greedy decode steps")->capture_default_str();
  cmd->add_option("--device", o->device, "cpu, ref (scalar backend) or reference (f32 oracle)")
      ->capture_default_str();
  cmd->add_option("-t,--threads", o->threads, "CPU threads (0: all)")->capture_default_str();
  cmd->add_option("-c,--ctx-size", o->n_ctx, "context size (0: the model's)")
      ->capture_default_str();
  cmd->add_option("--top-k", o->top_k, "logits listed per prompt position")->capture_default_str();
  cmd->callback([o, &exit_code] { exit_code = run_logits(*o); });
}

}  // namespace kiln::app
