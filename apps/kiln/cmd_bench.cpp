// apps/kiln/cmd_bench.cpp: `kiln bench`: llama-bench-style figures. ppN: one N-token batch
// from an empty cache; tgN: N single-token decode steps from an empty cache. Each test runs
// once to warm up, then -r times; reported as mean +- stddev of tokens/s. tg also reports the
// weight bytes one decoded token reads (all dense weights except the embedding table, of
// which one row; for MoE layers only the experts the run's own routing selected, counted by
// the forward pass), the read bandwidth of this machine measured right before and right after
// every repetition, the roofline tokens/s those two give, and tg as a fraction of it: each
// repetition against the mean of its own two neighbouring probes, the median of those
// fractions reported with their range (on a tensor-parallel group the bandwidth of all its
// GPUs together). Pairing each repetition with its neighbours is what makes the fraction
// steady on a shared VM, where the bandwidth drifts by 1.5x within minutes. Also the process's
// anonymous resident memory (everything beyond the mapped weights). --n-seq S adds
// tgN xS: S sequences decoded together, N steps of one token each through BatchEval
// (llama-batched-bench's parallel decode), reported as the aggregate tokens/s of all S.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "apps/kiln/commands.h"
#include "apps/kiln/config_cli.h"
#include "apps/kiln/gen_common.h"
#include "core/counters.h"
#include "core/half.h"
#include "core/log.h"
#include "core/splitmix.h"
#include "sampling/sampler.h"
#include "engine/device_probe.h"
#include "engine/read_probe.h"
#include "engine/runtime.h"
#include "kv/kv_cache.h"

namespace kiln::app {
namespace {

struct BenchOptions {
  std::string model;
  std::vector<int32_t> n_prompt{512};
  std::vector<int32_t> n_gen{128};
  std::vector<int32_t> n_seq;  // batched decode widths (tgN xS), none by default
  // llama-bench's -d: each test runs after this many tokens already in the KV cache ("tg128 @
  // d4096"); the prefix is filled once per depth, untimed, and every repetition rolls back to it.
  std::vector<int32_t> n_depth{0};
  // How the -d prefix gets into the cache: "eval" (the model evaluates it, as llama-bench) or
  // "random" (random rows written straight into the cache: linear instead of quadratic time,
  // for decode speed at depths whose prefill would take hours; the rows mean nothing).
  std::string depth_fill = "eval";
  int32_t reps = 5;
  std::string output = "md";
  bool cuda_profile = false, cuda_trace = false;
  std::shared_ptr<ConfigOverrides> config;
};

struct Result {
  std::string test;  // "pp512" / "tg128" / "tg128 x16"
  int32_t n_prompt = 0, n_gen = 0, n_seq = 1, n_depth = 0;
  std::vector<double> ts;  // tokens/s per repetition
  double mean = 0, stddev = 0;
  double gbps = 0;  // tg only: weight bytes per token / seconds per token
  // tg only (see the file comment): bytes one token read, split into the dense part and the
  // experts the routing selected; per repetition the mean of the bandwidth probes right
  // before and after it and the repetition's tokens/s as a fraction of that roofline; the
  // headline figures are the medians (read_gbps, roofline_fraction), roofline_ts their
  // roofline.
  double bytes_per_token = 0, dense_bytes = 0, expert_bytes = 0;
  double read_gbps = 0, roofline_ts = 0, roofline_fraction = 0;
  std::vector<double> read_gbps_samples, fraction_samples;
  double read_best_gbps = 0;  // the run's fastest probe, and the read method that gave it
  std::string read_method;
  double fraction_min = 0, fraction_max = 0;
  std::string profile;       // --cuda-profile: the per-kernel table of one extra pass
  std::string trace;         // --cuda-trace: the kernel records' table of one extra pass
  std::string host_note;     // CUDA: how much of the run the host waited on the GPU
  double attn_kv_bytes = 0;  // sparse attention: KV bytes one token's attention reads
};

// Weight bytes a decode step reads outside the experts: every tensor once, except that the
// token embedding contributes one row (a lookup) unless it doubles as the output matrix; the
// stacked expert tensors (*_exps) are left to the forward pass's counter, and the blocks after
// the main pass's layers (NextN/MTP blocks, HParams::nextn_layers) are not read by a decode step.
double dense_bytes_per_token(const Model& model) {
  double bytes = 0;
  const int32_t n_layer = model.hparams().n_layer;
  for (const TensorInfo& t : model.gguf().tensors()) {
    if (t.name.find("_exps.") != std::string::npos) continue;
    if (t.name.starts_with("blk.") && std::atoi(t.name.c_str() + 4) >= n_layer) continue;
    if (t.name == "token_embd.weight") {
      bytes += double(t.n_bytes) / double(t.n_rows());
      if (!model.weights().tied_output) continue;
    }
    bytes += double(t.n_bytes);
  }
  return bytes;
}

// The middle value (the mean of the middle two for an even count); v is not empty.
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

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

// Each timed pass starts from the first `depth` positions of the cache (filled by fill_prefix).
Expected<double> time_prefill(Session& s, std::span<const int32_t> tokens, int32_t depth) {
  KILN_TRY(s.rollback(depth));
  const auto t0 = Clock::now();
  KILN_TRY(s.eval(tokens, false));
  return double(tokens.size()) / std::chrono::duration<double>(Clock::now() - t0).count();
}

Expected<double> time_decode(Session& s, std::span<const int32_t> tokens, int32_t depth) {
  KILN_TRY(s.rollback(depth));
  const auto t0 = Clock::now();
  for (int32_t id : tokens) {
    const int32_t one[1] = {id};
    KILN_TRY(s.eval(one, false));
  }
  return double(tokens.size()) / std::chrono::duration<double>(Clock::now() - t0).count();
}

// S sessions from their first `depth` positions, then n steps in which each appends one token,
// all S in one BatchEval step: aggregate tokens/s.
Expected<double> time_batched_decode(std::span<const std::unique_ptr<Session>> seqs,
                                     BatchEval& batch, std::span<const int32_t> tokens,
                                     int32_t depth) {
  for (const auto& s : seqs) KILN_TRY(s->rollback(depth));
  std::vector<BatchEval::Item> items(seqs.size());
  const auto t0 = Clock::now();
  for (size_t step = 0; step < tokens.size(); ++step) {
    for (size_t i = 0; i < seqs.size(); ++i)
      items[i] = {seqs[i].get(), tokens.subspan((step + i) % tokens.size(), 1), false};
    KILN_TRY(batch.eval(items));
  }
  return double(tokens.size() * seqs.size()) /
         std::chrono::duration<double>(Clock::now() - t0).count();
}

// Sparse attention: the KV bytes (f16) one decoded token's attention reads at the middle of
// a tg test over all layers -- with selection, each layer's top_k latent rows plus, on full
// layers, every indexer key; dense, every latent row. Sets r.attn_kv_bytes, returns the note.
std::string attention_kv_note(const model::HParams& hp, Result& r) {
  const double n_kv = double(r.n_depth) + double(r.n_gen) / 2;
  const double row = double(hp.kv_k_width()) * 2, idx_row = double(hp.dsa.head_dim) * 2;
  const bool dense = r.test.find("dense") != std::string::npos;
  double bytes = 0;
  for (const model::LayerDesc& L : hp.layers) {
    bytes += (dense ? n_kv : std::min(n_kv, double(hp.dsa.top_k))) * row;
    if (!dense && L.indexer == model::IndexerKind::Full) bytes += n_kv * idx_row;
  }
  r.attn_kv_bytes = bytes;
  return fmt::format("{}: attention reads {:.2f} MB of KV per token ({}, {:.0f} keys)\n", r.test,
                     bytes * 1e-6, dense ? "dense" : "sparse", n_kv);
}

// --depth-fill random: a fresh cache of the session's geometry holding n_pos positions whose
// every row (latent, K/V, indexer keys) is uniform in [-1, 1], installed in the session. Decode
// cost at a depth does not depend on what the rows hold (sparse selection scores and ranks
// every key either way), so the timings stand; the outputs mean nothing. Host caches of full
// layers only: a device plane cannot be written from here, and a ring's retained range is
// the forward pass's business.
Status fill_random(Session& s, int32_t n_pos) {
  const KvCache& mine = s.kv_cache();
  if (mine.on_device())
    return Status::error("--depth-fill random: the cache lives in device memory (CPU only)");
  KvConfig cfg;
  cfg.n_ctx = mine.n_ctx();
  cfg.max_batch = mine.max_batch();
  cfg.backend = mine.backend();
  for (int l = 0; l < mine.n_layers(); ++l) {
    if (mine.window(l) > 0)
      return Status::error("--depth-fill random: sliding-window layers are not supported");
    cfg.layers.push_back(
        KvLayerSpec{.width = mine.width(l), .window = 0, .k_only = mine.k_only(l)});
  }
  KILN_ASSIGN_OR_RETURN(KvCache kv, KvCache::create(cfg));
  KILN_TRY(kv.restore(n_pos, std::vector<int32_t>(size_t(kv.n_layers()), 0)));
  uint64_t state = 0x6b696c6e;
  auto fill = [&](std::span<f16> plane, int64_t width, std::span<const int32_t> rows) {
    for (int32_t r : rows)
      for (f16& x : plane.subspan(size_t(r) * size_t(width), size_t(width)))
        x = f32_to_f16(float(double(splitmix64(state) >> 11) * 0x1.0p-52 - 1.0));
  };
  for (int l = 0; l < kv.n_layers(); ++l) {
    fill(kv.k_plane(l), kv.width(l), kv.kv_rows(l));
    if (!kv.k_only(l)) fill(kv.v_plane(l), kv.width(l), kv.kv_rows(l));
  }
  return s.install_kv(std::move(kv));
}

// The untimed context of -d: the session's cache holds exactly `prefix` afterwards (or, with
// --depth-fill random, as many random rows).
Status fill_prefix(Session& s, std::span<const int32_t> prefix, bool random) {
  KILN_TRY(s.rollback(0));
  if (random && !prefix.empty()) return fill_random(s, int32_t(prefix.size()));
  if (!prefix.empty()) KILN_TRY(s.eval(prefix, false));
  return Status::ok();
}

Status run(const BenchOptions& o) {
  KILN_ASSIGN_OR_RETURN(Config cfg, load_config(*o.config));
  if (auto lvl = parse_log_level(cfg.log_level)) set_log_level(*lvl);
  if (o.output != "md" && o.output != "json")
    return Status::errorf("-o '{}': expected md or json", o.output);
  if (o.reps <= 0) return Status::errorf("-r {} must be > 0", o.reps);
  if (o.depth_fill != "eval" && o.depth_fill != "random")
    return Status::errorf("--depth-fill '{}': expected eval or random", o.depth_fill);
  const bool random_fill = o.depth_fill == "random";
  int32_t n_max = 1;
  for (int32_t p : o.n_prompt) {
    if (p < 0) return Status::errorf("-p {} must be >= 0", p);
    n_max = std::max(n_max, p);
  }
  for (int32_t n : o.n_gen) {
    if (n < 0) return Status::errorf("-n {} must be >= 0", n);
    n_max = std::max(n_max, n);
  }
  for (int32_t s : o.n_seq)
    if (s < 1 || s > 1024) return Status::errorf("--n-seq {} must be 1..1024", s);
  int32_t most_depth = 0;
  for (int32_t d : o.n_depth) {
    if (d < 0) return Status::errorf("-d {} must be >= 0", d);
    most_depth = std::max(most_depth, d);
  }
  n_max += most_depth;
  KILN_ASSIGN_OR_RETURN(std::string path, resolve_model_path(o.model, cfg));
  KILN_ASSIGN_OR_RETURN(const EngineOptions eo, engine_options(cfg));
  KILN_ASSIGN_OR_RETURN(Runtime rt, Runtime::open(path, eo));
  const Model& model = *rt.model();
  Backend& backend = rt.backend();
  if (n_max > model.n_ctx_train())
    log_notice("bench: {} tokens exceed the model's training context {}", n_max,
               model.n_ctx_train());
  Session session(rt.model(), backend, n_max);
  const MemoryUse mem_before = memory_use();
  const int threads = cfg.threads > 0 ? int(cfg.threads) : int(std::thread::hardware_concurrency());
  // Counts the expert weight bytes every forward pass computed with (model/forward.cpp).
  const Counter& expert_bytes = process_counters().counter("moe.expert_bytes_used");
  std::unique_ptr<ReadProbe> bandwidth;
  // A device backend streams weights from its own memory: its bandwidth is the roofline.
  double device_gbps = 0;
  // A tensor-parallel group reads each rank's share of the weights from that rank's memory at
  // once: its roofline bandwidth is the sum over the ranks (rank 0's reading, times N).
  for (int32_t ng : o.n_gen)
    if (ng > 0 && backend.device_memory() && device_gbps == 0)
      device_gbps = backend.read_bandwidth_gbps() * backend.tp_size();
  for (int32_t ng : o.n_gen)
    if (ng > 0 && !bandwidth && device_gbps == 0) bandwidth = std::make_unique<ReadProbe>(threads);

  std::vector<Result> results;
  auto bench = [&](const std::string& name, int32_t np, int32_t ng, int32_t n_seq, int32_t depth,
                   auto&& fn) -> Status {
    Result r;
    r.test = depth > 0 ? fmt::format("{} @ d{}", name, depth) : name;
    r.n_prompt = np;
    r.n_gen = ng;
    r.n_seq = n_seq;
    r.n_depth = depth;
    const bool roofline = ng > 0 && n_seq == 1;  // one sequence's decode: weight-bound
    const std::vector<int32_t> tokens = random_tokens(np + ng, model.n_vocab(), 1234);
    KILN_TRY(fn(tokens));  // warm-up: page in weights, size scratch buffers
    const DeviceCounters dev0 = device_counters(backend);
    const auto wall0 = Clock::now();
    uint64_t expert_bytes_run = 0;
    // Probes alternate with the repetitions (P0 R1 P1 R2 P2 ...): repetition i is paired with
    // the mean of the probes on either side of it, each probe serving both its neighbours.
    const bool probe = roofline && device_gbps == 0;
    const auto read = [&] {
      if (!probe) return device_gbps;
      const ReadProbe::Reading m = bandwidth->measure();
      if (m.gbps > r.read_best_gbps) {
        r.read_best_gbps = m.gbps;
        r.read_method = cpu::read_method_name(m.method);
      }
      return m.gbps;
    };
    double before = read();
    for (int32_t i = 0; i < o.reps; ++i) {
      const uint64_t e0 = expert_bytes.value();
      KILN_ASSIGN_OR_RETURN(double ts, fn(tokens));
      expert_bytes_run += expert_bytes.value() - e0;
      r.ts.push_back(ts);
      if (roofline) {
        const double after = read();
        r.read_gbps_samples.push_back((before + after) / 2);
        before = after;
      }
    }
    summarise(r);
    if (dev0.available) {
      // Host-bound or GPU-bound: the share of the timed runs' wall time the host spent waiting
      // for the GPU at the end of segments (the rest it spent recording and launching ops).
      const DeviceCounters dev1 = device_counters(backend);
      const double wall_ms =
          std::chrono::duration<double, std::milli>(Clock::now() - wall0).count();
      const double wait = dev1.segment_wait_ms - dev0.segment_wait_ms;
      const double n_waits = double(dev1.segment_waits - dev0.segment_waits);
      r.host_note = fmt::format(
          "{}: the host waited for the GPU {:.1f} % of the timed runs' {:.0f} ms ({} waits, "
          "{:.1f} µs each); graphs: {} captured, {} replayed, {} segments op by op\n",
          name, wall_ms > 0 ? 100 * wait / wall_ms : 0.0, wall_ms, uint64_t(n_waits),
          n_waits > 0 ? wait * 1e3 / n_waits : 0.0, dev1.graph_captures - dev0.graph_captures,
          dev1.graph_replays - dev0.graph_replays, dev1.segments_eager - dev0.segments_eager);
      if (dev1.l2_prefetch_hints > dev0.l2_prefetch_hints)
        r.host_note +=
            fmt::format("{}: L2 prefetch: {} hints recorded, {:.1f} MiB each on average\n", name,
                        dev1.l2_prefetch_hints - dev0.l2_prefetch_hints,
                        double(dev1.l2_prefetch_bytes - dev0.l2_prefetch_bytes) / 1048576.0 /
                            double(dev1.l2_prefetch_hints - dev0.l2_prefetch_hints));
    }
    if (o.cuda_profile || o.cuda_trace) {
      ProbePass pass;
      pass.test = r.test;
      pass.decode = r.n_gen > 0;
      pass.steps = r.n_gen > 0 ? double(r.n_gen) : 1.0;
      const double tok_per_step = r.n_gen > 0 ? double(r.n_seq) : double(r.n_prompt);
      pass.step_us = r.mean > 0 ? tok_per_step / r.mean * 1e6 : 0;
      pass.run = [&] { return fn(tokens); };
      if (o.cuda_profile) {
        KILN_ASSIGN_OR_RETURN(r.profile, profile_pass(backend, pass));
      }
      if (o.cuda_trace) {
        KILN_ASSIGN_OR_RETURN(r.trace, trace_pass(backend, pass));
      }
    }
    if (roofline) {
      r.dense_bytes = dense_bytes_per_token(model);
      r.expert_bytes = double(expert_bytes_run) / (double(ng) * o.reps);
      r.bytes_per_token = r.dense_bytes + r.expert_bytes;
      r.gbps = r.bytes_per_token * r.mean * 1e-9;
      for (size_t i = 0; i < r.ts.size(); ++i) {
        const double bw = r.read_gbps_samples[i];
        r.fraction_samples.push_back(bw > 0 ? r.ts[i] * r.bytes_per_token / (bw * 1e9) : 0);
      }
      r.read_gbps = median(r.read_gbps_samples);
      r.roofline_ts = r.read_gbps * 1e9 / r.bytes_per_token;
      r.roofline_fraction = median(r.fraction_samples);
      r.fraction_min = *std::min_element(r.fraction_samples.begin(), r.fraction_samples.end());
      r.fraction_max = *std::max_element(r.fraction_samples.begin(), r.fraction_samples.end());
    }
    results.push_back(std::move(r));
    return Status::ok();
  };
  // The -d prefix of each depth: its own tokens (not those of the tests), the same for every
  // sequence.
  auto prefix_of = [&](int32_t d) { return random_tokens(d, model.n_vocab(), 99); };
  for (int32_t d : o.n_depth) {
    const std::vector<int32_t> prefix = prefix_of(d);
    KILN_TRY(fill_prefix(session, prefix, random_fill));
    for (int32_t np : o.n_prompt)
      if (np > 0)
        KILN_TRY(bench(fmt::format("pp{}", np), np, 0, 1, d,
                       [&](const std::vector<int32_t>& t) { return time_prefill(session, t, d); }));
    for (int32_t ng : o.n_gen)
      if (ng > 0)
        KILN_TRY(bench(fmt::format("tg{}", ng), 0, ng, 1, d,
                       [&](const std::vector<int32_t>& t) { return time_decode(session, t, d); }));
  }
  // Sparse attention (glm-dsa): the same decode tests on the same file with the selection off
  // (Model::LoadOptions::dsa_dense, set here only), the dense baseline, and per test the KV
  // bytes one token's attention reads (attention_kv_note).
  if (model.hparams().is_dsa()) {
    Model::LoadOptions dense_opts;
    dense_opts.dsa_dense = true;
    KILN_ASSIGN_OR_RETURN(auto dense, Model::load(path, dense_opts));
    Session dense_session(dense, backend, n_max);
    for (int32_t d : o.n_depth) {
      KILN_TRY(fill_prefix(dense_session, prefix_of(d), random_fill));
      for (int32_t ng : o.n_gen)
        if (ng > 0)
          KILN_TRY(bench(
              fmt::format("tg{} dense", ng), 0, ng, 1, d,
              [&](const std::vector<int32_t>& t) { return time_decode(dense_session, t, d); }));
    }
    for (Result& r : results)
      if (r.n_gen > 0 && r.n_seq == 1) r.host_note += attention_kv_note(model.hparams(), r);
  }
  for (int32_t ns : o.n_seq) {
    // The batched sessions only ever step one token, so their scratch is sized for one; with
    // -d they also prefill the prefix, in chunks of 256 (one token at a time, 4096 tokens of
    // prefix for 16 sequences were 65536 decode steps).
    const int32_t seq_batch = most_depth > 0 ? 256 : 1;
    std::vector<std::unique_ptr<Session>> seqs;
    for (int32_t i = 0; i < ns; ++i)
      seqs.push_back(std::make_unique<Session>(rt.model(), backend, n_max, seq_batch));
    BatchEval batch(rt.model(), backend, ns);
    for (int32_t d : o.n_depth) {
      const std::vector<int32_t> prefix = prefix_of(d);
      for (const auto& s : seqs) KILN_TRY(fill_prefix(*s, prefix, random_fill));
      for (int32_t ng : o.n_gen)
        if (ng > 0)
          KILN_TRY(bench(fmt::format("tg{} x{}", ng, ns), 0, ng, ns, d,
                         [&](const std::vector<int32_t>& t) {
                           return time_batched_decode(seqs, batch, t, d);
                         }));
    }
  }
  bandwidth.reset();  // its 512 MiB are not part of the memory figures below
  const MemoryUse mem = memory_use();

  const double size_gib = double(model.weight_bytes()) / double(1ull << 30);
  int64_t n_params = 0;
  for (const TensorInfo& t : model.gguf().tensors()) n_params += t.n_elements();
  const std::string model_name = std::filesystem::path(path).filename().string();
  if (o.output == "json") {
    nlohmann::json arr = nlohmann::json::array();
    for (const Result& r : results) {
      nlohmann::json j = {{"model", model_name},
                          {"model_type", model.arch_name()},
                          {"model_size", model.weight_bytes()},
                          {"model_n_params", n_params},
                          {"backend", std::string(backend.name())},
                          {"n_threads", threads},
                          {"test", r.test},
                          {"n_prompt", r.n_prompt},
                          {"n_gen", r.n_gen},
                          {"n_seq", r.n_seq},
                          {"n_depth", r.n_depth},
                          {"avg_ts", r.mean},
                          {"stddev_ts", r.stddev},
                          {"samples_ts", r.ts},
                          {"kv_bytes", session.kv_bytes()},
                          {"kv_bytes_per_token", session.kv_bytes_per_token()},
                          {"rss_bytes", mem.rss},
                          {"rss_anon_bytes", mem.rss_anon},
                          {"rss_anon_before_bytes", mem_before.rss_anon}};
      if (r.n_gen > 0 && r.n_seq == 1) {
        j["weight_gbps"] = r.gbps;
        j["bytes_per_token"] = r.bytes_per_token;
        j["dense_bytes_per_token"] = r.dense_bytes;
        j["expert_bytes_per_token"] = r.expert_bytes;
        j["read_gbps"] = r.read_gbps;
        j["roofline_ts"] = r.roofline_ts;
        j["roofline_fraction"] = r.roofline_fraction;
        j["read_gbps_samples"] = r.read_gbps_samples;
        if (!r.read_method.empty()) j["read_method"] = r.read_method;
        j["roofline_fraction_samples"] = r.fraction_samples;
        j["roofline_fraction_min"] = r.fraction_min;
        j["roofline_fraction_max"] = r.fraction_max;
        if (r.attn_kv_bytes > 0) j["attention_kv_bytes_per_token"] = r.attn_kv_bytes;
      }
      arr.push_back(std::move(j));
    }
    fmt::print("{}\n", arr.dump(2));
  } else {
    fmt::print("| model | size | params | backend | threads | test | t/s | GB/s |\n");
    fmt::print("| ----- | ---: | -----: | ------- | ------: | ---: | --: | ---: |\n");
    for (const Result& r : results)
      fmt::print("| {} {} | {:.2f} GiB | {:.2f} B | {} | {} | {} | {:.2f} ± {:.2f} | {} |\n",
                 model.arch_name(), model_name, size_gib, double(n_params) * 1e-9, backend.name(),
                 threads, r.test, r.mean, r.stddev,
                 r.n_gen > 0 && r.n_seq == 1 ? fmt::format("{:.1f}", r.gbps) : std::string("-"));
    for (const Result& r : results)
      if (r.n_gen > 0 && r.n_seq == 1) {
        std::string bws;
        for (double g : r.read_gbps_samples)
          bws += fmt::format("{}{:.1f}", bws.empty() ? "" : " ", g);
        fmt::print(
            "\n{}: {:.2f} MB of weights read per token ({:.2f} MB dense + {:.2f} MB of the "
            "experts this run routed to); read bandwidth {:.1f} GB/s (same run; median over "
            "the repetitions of the probes either side of each: {}{}) -> roofline {:.1f} t/s; "
            "tg = {:.1f} % of it (median of the repetitions' fractions, each against its "
            "own probes; range {:.1f}-{:.1f} %)\n",
            r.test, r.bytes_per_token * 1e-6, r.dense_bytes * 1e-6, r.expert_bytes * 1e-6,
            r.read_gbps, bws,
            r.read_method.empty() ? std::string()
                                  : fmt::format("; fastest read method: {}", r.read_method),
            r.roofline_ts, 100 * r.roofline_fraction, 100 * r.fraction_min, 100 * r.fraction_max);
      }
    for (const Result& r : results) fmt::print("{}", r.host_note);
    for (const Result& r : results) fmt::print("{}", r.profile);
    for (const Result& r : results) fmt::print("{}", r.trace);
    fmt::print(
        "\nresident memory: {:.1f} MiB total, {:.1f} MiB file-backed{}, {:.1f} MiB anonymous "
        "({}KV cache {:.1f} MiB, {} bytes per token; + activations + runtime)\n",
        double(mem.rss) / (1 << 20), double(mem.rss_file) / (1 << 20),
        rt.weights_in_anonymous_memory() ? "" : " (mapped weights)",
        double(mem.rss_anon) / (1 << 20),
        rt.weights_in_anonymous_memory()
            ? fmt::format("the model file {:.1f} MiB, moved into huge pages; ",
                          double(model.gguf().mapping()->size()) / (1 << 20))
            : std::string(),
        double(session.kv_bytes()) / (1 << 20), session.kv_bytes_per_token());
  }
  if (cfg.stats) {  // counters (expert store: hits, misses, bytes, stall) and the store summary
    const auto counters = process_counters().snapshot();
    if (!counters.empty()) fmt::print(stderr, "stats: counters\n{}", format_counters(counters));
    fmt::print(stderr, "{}", moe::format_store_stats());
  }
  return Status::ok();
}

}  // namespace

void add_bench_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("bench", "prompt-processing and generation speed (llama-bench)");
  cmd->footer(
      "tgN roofline: bytes per token = every dense weight once, one embedding row, and the expert "
      "slices this run's routing selected (counted by the forward pass). Around every repetition "
      "the streaming read bandwidth is probed in the same process (512 MiB in one buffer per "
      "thread, --threads threads, the best of every read method of the probe, two passes each; "
      "probes alternate with the repetitions); each repetition's tokens/s is "
      "divided by the roofline of the mean of its two neighbouring probes, and the median of "
      "those fractions is reported with their range (-o json: roofline_fraction, "
      "roofline_fraction_samples/_min/_max, read_gbps (median), read_gbps_samples, read_method: "
      "the "
      "method of the run's fastest probe).");
  auto o = std::make_shared<BenchOptions>();
  cmd->add_option("-m,--model", o->model, "GGUF model (default: the demo model stories260K)");
  cmd->add_option("-p,--n-prompt", o->n_prompt, "prompt lengths to test (default 512)")
      ->delimiter(',');
  cmd->add_option("-n,--n-gen", o->n_gen, "generation lengths to test (default 128)")
      ->delimiter(',');
  cmd->add_option("--n-seq", o->n_seq,
                  "also decode this many sequences together (tgN xS, aggregate t/s; list)")
      ->delimiter(',');
  cmd->add_option("-d,--n-depth", o->n_depth,
                  "run each test after this many tokens already in the KV cache (tgN @ dD; "
                  "filled once per depth, untimed; list; default 0)")
      ->delimiter(',');
  cmd->add_option("--depth-fill", o->depth_fill,
                  "how -d's prefix gets into the cache: eval (the model evaluates it) or random "
                  "(random rows written into the cache, CPU: decode speed at depths whose "
                  "prefill takes too long; outputs meaningless)");
  cmd->add_option("-r,--repetitions", o->reps, "repetitions per test (default 5)");
  cmd->add_option("-o,--output", o->output, "md or json (default md)");
  cmd->add_flag("--cuda-profile", o->cuda_profile,
                "CUDA: time one more pass of each test op by op with CUDA events and print the "
                "per-kernel table");
  cmd->add_flag("--cuda-trace", o->cuda_trace,
                "CUDA: one more pass of each test under CUPTI's kernel records (graphs and PDL "
                "as configured) and print the kernels' GPU time per step and the idle time");
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
