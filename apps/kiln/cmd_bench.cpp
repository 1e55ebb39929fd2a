// apps/kiln/cmd_bench.cpp: `kiln bench`: llama-bench-style figures. ppN: one N-token batch
// from an empty cache; tgN: N single-token decode steps from an empty cache. Each test runs
// once to warm up, then -r times; reported as mean +- stddev of tokens/s. tg also reports the
// achieved weight bandwidth (every decode step reads all weight bytes once) and the process's
// anonymous resident memory (everything beyond the mapped weights).
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <thread>
#include <memory>
#include <string>
#include <vector>

#include "apps/kiln/commands.h"
#include "apps/kiln/config_cli.h"
#include "apps/kiln/gen_common.h"
#include "core/log.h"
#include "sampling/sampler.h"

namespace kiln::app {
namespace {

struct BenchOptions {
  std::string model;
  std::vector<int32_t> n_prompt{512};
  std::vector<int32_t> n_gen{128};
  int32_t reps = 5;
  std::string output = "md";
  std::shared_ptr<ConfigOverrides> config;
};

struct Result {
  std::string test;  // "pp512" / "tg128"
  int32_t n_prompt = 0, n_gen = 0;
  std::vector<double> ts;  // tokens/s per repetition
  double mean = 0, stddev = 0;
  double gbps = 0;  // tg only: weight bytes per token / seconds per token
};

void summarise(Result& r) {
  double s = 0;
  for (double x : r.ts) s += x;
  r.mean = s / double(r.ts.size());
  double v = 0;
  for (double x : r.ts) v += (x - r.mean) * (x - r.mean);
  r.stddev = r.ts.size() > 1 ? std::sqrt(v / double(r.ts.size() - 1)) : 0;
}

using Clock = std::chrono::steady_clock;

// Token ids drawn once with a fixed seed (llama-bench also feeds random tokens).
std::vector<int32_t> random_tokens(int32_t n, int32_t n_vocab, uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int32_t& x : t) x = static_cast<int32_t>(rng.next() % uint64_t(n_vocab));
  return t;
}

Expected<double> time_prefill(Session& s, std::span<const int32_t> tokens) {
  KILN_TRY(s.rollback(0));
  const auto t0 = Clock::now();
  KILN_TRY(s.eval(tokens, false));
  return double(tokens.size()) / std::chrono::duration<double>(Clock::now() - t0).count();
}

Expected<double> time_decode(Session& s, std::span<const int32_t> tokens) {
  KILN_TRY(s.rollback(0));
  const auto t0 = Clock::now();
  for (int32_t id : tokens) {
    const int32_t one[1] = {id};
    KILN_TRY(s.eval(one, false));
  }
  return double(tokens.size()) / std::chrono::duration<double>(Clock::now() - t0).count();
}

Status run(const BenchOptions& o) {
  KILN_ASSIGN_OR_RETURN(Config cfg, load_config(*o.config));
  if (auto lvl = parse_log_level(cfg.log_level)) set_log_level(*lvl);
  if (o.output != "md" && o.output != "json")
    return Status::errorf("-o '{}': expected md or json", o.output);
  if (o.reps <= 0) return Status::errorf("-r {} must be > 0", o.reps);
  int32_t n_max = 1;
  for (int32_t p : o.n_prompt) {
    if (p < 0) return Status::errorf("-p {} must be >= 0", p);
    n_max = std::max(n_max, p);
  }
  for (int32_t n : o.n_gen) {
    if (n < 0) return Status::errorf("-n {} must be >= 0", n);
    n_max = std::max(n_max, n);
  }
  KILN_ASSIGN_OR_RETURN(std::string path, resolve_model_path(o.model, cfg));
  KILN_ASSIGN_OR_RETURN(Loaded ld, load_for_inference(path, static_cast<int>(cfg.threads)));
  const Model& model = *ld.model;
  if (n_max > model.n_ctx_train())
    log_notice("bench: {} tokens exceed the model's training context {}", n_max,
               model.n_ctx_train());
  Session session(ld.model, *ld.backend, n_max);
  const MemoryUse mem_before = memory_use();

  std::vector<Result> results;
  auto bench = [&](const std::string& name, int32_t np, int32_t ng, auto&& fn) -> Status {
    Result r{name, np, ng, {}, 0, 0, 0};
    const std::vector<int32_t> tokens = random_tokens(np + ng, model.n_vocab(), 1234);
    KILN_TRY(fn(tokens));  // warm-up: page in weights, size scratch buffers
    for (int32_t i = 0; i < o.reps; ++i) {
      KILN_ASSIGN_OR_RETURN(double ts, fn(tokens));
      r.ts.push_back(ts);
    }
    summarise(r);
    if (ng > 0) r.gbps = double(model.weight_bytes()) * r.mean * 1e-9;
    results.push_back(std::move(r));
    return Status::ok();
  };
  for (int32_t np : o.n_prompt)
    if (np > 0)
      KILN_TRY(bench(fmt::format("pp{}", np), np, 0,
                     [&](const std::vector<int32_t>& t) { return time_prefill(session, t); }));
  for (int32_t ng : o.n_gen)
    if (ng > 0)
      KILN_TRY(bench(fmt::format("tg{}", ng), 0, ng,
                     [&](const std::vector<int32_t>& t) { return time_decode(session, t); }));
  const MemoryUse mem = memory_use();

  const double size_gib = double(model.weight_bytes()) / double(1ull << 30);
  int64_t n_params = 0;
  for (const TensorInfo& t : model.gguf().tensors()) n_params += t.n_elements();
  const int threads = cfg.threads > 0 ? int(cfg.threads) : int(std::thread::hardware_concurrency());
  const std::string model_name = std::filesystem::path(path).filename().string();
  if (o.output == "json") {
    nlohmann::json arr = nlohmann::json::array();
    for (const Result& r : results) {
      nlohmann::json j = {{"model", model_name},
                          {"model_type", model.arch_name()},
                          {"model_size", model.weight_bytes()},
                          {"model_n_params", n_params},
                          {"backend", std::string(ld.backend->name())},
                          {"n_threads", threads},
                          {"test", r.test},
                          {"n_prompt", r.n_prompt},
                          {"n_gen", r.n_gen},
                          {"avg_ts", r.mean},
                          {"stddev_ts", r.stddev},
                          {"samples_ts", r.ts},
                          {"kv_bytes", session.kv_bytes()},
                          {"rss_bytes", mem.rss},
                          {"rss_anon_bytes", mem.rss_anon},
                          {"rss_anon_before_bytes", mem_before.rss_anon}};
      if (r.n_gen > 0) j["weight_gbps"] = r.gbps;
      arr.push_back(std::move(j));
    }
    fmt::print("{}\n", arr.dump(2));
  } else {
    fmt::print("| model | size | params | backend | threads | test | t/s | GB/s |\n");
    fmt::print("| ----- | ---: | -----: | ------- | ------: | ---: | --: | ---: |\n");
    for (const Result& r : results)
      fmt::print("| {} {} | {:.2f} GiB | {:.2f} B | {} | {} | {} | {:.2f} ± {:.2f} | {} |\n",
                 model.arch_name(), model_name, size_gib, double(n_params) * 1e-9,
                 ld.backend->name(), threads, r.test, r.mean, r.stddev,
                 r.n_gen > 0 ? fmt::format("{:.1f}", r.gbps) : std::string("-"));
    fmt::print("\nresident memory: {:.1f} MiB total, {:.1f} MiB file-backed (mapped weights), "
               "{:.1f} MiB anonymous (KV cache {:.1f} MiB + activations + runtime)\n",
               double(mem.rss) / (1 << 20), double(mem.rss_file) / (1 << 20),
               double(mem.rss_anon) / (1 << 20), double(session.kv_bytes()) / (1 << 20));
  }
  return Status::ok();
}

}  // namespace

void add_bench_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("bench", "prompt-processing and generation speed (llama-bench)");
  auto o = std::make_shared<BenchOptions>();
  cmd->add_option("-m,--model", o->model, "GGUF model (default: the demo model stories260K)");
  cmd->add_option("-p,--n-prompt", o->n_prompt, "prompt lengths to test (default 512)")
      ->delimiter(',');
  cmd->add_option("-n,--n-gen", o->n_gen, "generation lengths to test (default 128)")
      ->delimiter(',');
  cmd->add_option("-r,--repetitions", o->reps, "repetitions per test (default 5)");
  cmd->add_option("-o,--output", o->output, "md or json (default md)");
  o->config = add_config_options(cmd);
  cmd->callback([o, &exit_code] {
    if (Status s = run(*o); !s) {
      std::fflush(stdout);
      fmt::print(stderr, "kiln bench: {}\n", s.message());
      exit_code = 1;
    }
  });
}

}  // namespace kiln::app
