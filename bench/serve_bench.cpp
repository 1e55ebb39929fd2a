// bench/serve_bench.cpp: serving throughput of the slot scheduler (issue 7), in-process (no
// HTTP): S client threads each send R requests back to back (random prompt, fixed number of
// generated tokens, greedy, no early stop) to a scheduler with S slots. Reports aggregate
// generated tokens/s and time to first token (p50/p99) under that load, for batched steps
// (one forward pass per step for all slots) and, in the same process right after, for the
// unbatched path (one forward call per slot), next to single-stream decode of one Session
// (what `kiln bench` tg measures) and the time of one batched decode step by batch width.
// The CPU is shared with other work on the dev machine, so compare the ratios within one run.
// Usage: serve_bench MODEL [threads=2] [streams=1,4,16] [n_gen=64] [n_prompt=64] [rounds=2]
//                    [modes=batched,unbatched] [fast=1] [widths=0,1,2,4,8,16] [repeats=1]
// (repeats > 1: the streams list runs that many times in turn, and each batched run's aggregate
// is divided by the first stream count's run of the same pass, minutes apart at most, so the
// VM's drift cancels; the medians of those ratios are printed last.)
// (fast 0: the backend's portable kernels (CpuOptions::portable_kernels), for A/B runs of the
// fast ones; widths: the decode batch widths timed, 0 the Session::eval baseline, which
// x Session is against: list it first.)
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "engine/scheduler.h"

using namespace kiln;
using Clock = std::chrono::steady_clock;

namespace {

std::vector<int32_t> parse_list(const std::string& s) {
  std::vector<int32_t> out;
  size_t i = 0;
  while (i < s.size()) {
    const size_t j = std::min(s.find(',', i), s.size());
    out.push_back(std::atoi(s.substr(i, j - i).c_str()));
    i = j + 1;
  }
  return out;
}

std::vector<int32_t> random_tokens(int32_t n, int32_t n_vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int32_t& x : t) x = static_cast<int32_t>(rng() % static_cast<uint32_t>(n_vocab));
  return t;
}

double pct(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())))];
}

struct LoadResult {
  double seconds = 0, tokens_per_s = 0, ttft_p50_ms = 0, ttft_p99_ms = 0;
  int64_t tokens = 0, requests = 0, errors = 0;
};

LoadResult run_load(const std::shared_ptr<const Model>& m, Backend& be, int32_t streams,
                    bool batched, int32_t n_prompt, int32_t n_gen, int32_t rounds) {
  SchedulerConfig cfg;
  cfg.n_slots = streams;
  cfg.n_ctx = n_prompt + n_gen + 8;
  cfg.max_queue = streams;
  cfg.batch_decode = batched;
  auto sch = Scheduler::create(m, be, cfg);
  if (!sch) {
    fmt::print(stderr, "serve_bench: {}\n", sch.error());
    std::exit(1);
  }
  auto one = [&](uint32_t seed, std::vector<double>* ttft, int64_t* tokens, int64_t* errors) {
    GenerationParams p;
    p.prompt = random_tokens(n_prompt, m->n_vocab(), seed);
    p.sampling.temperature = 0;
    p.max_tokens = n_gen;
    const auto t0 = Clock::now();
    auto sub = (*sch)->submit(std::move(p));
    if (!sub.stream) {
      ++*errors;
      return;
    }
    bool first = true;
    for (;;) {
      auto e = sub.stream->next(std::chrono::seconds(600));
      if (!e) {
        ++*errors;
        return;
      }
      if (e->kind == GenEvent::Kind::kDone) {
        if (e->finish != FinishReason::kLength) ++*errors;
        return;
      }
      if (first && ttft)
        ttft->push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
      first = false;
      ++*tokens;
    }
  };
  // Warm-up: every slot once (pages in weights, sizes scratch), not timed.
  {
    std::vector<std::thread> th;
    std::vector<int64_t> tok(static_cast<size_t>(streams)), err(static_cast<size_t>(streams));
    for (int32_t c = 0; c < streams; ++c)
      th.emplace_back([&, c] { one(9000u + static_cast<uint32_t>(c), nullptr, &tok[c], &err[c]); });
    for (auto& t : th) t.join();
  }
  std::vector<std::vector<double>> ttft(static_cast<size_t>(streams));
  std::vector<int64_t> tokens(static_cast<size_t>(streams)), errors(static_cast<size_t>(streams));
  const auto t0 = Clock::now();
  std::vector<std::thread> th;
  for (int32_t c = 0; c < streams; ++c)
    th.emplace_back([&, c] {
      // Staggered starts, so requests are at different stages (prefill beside decode).
      std::this_thread::sleep_for(std::chrono::milliseconds(7 * c));
      for (int32_t r = 0; r < rounds; ++r)
        one(static_cast<uint32_t>(c * 1000 + r), &ttft[c], &tokens[c], &errors[c]);
    });
  for (auto& t : th) t.join();
  LoadResult res;
  res.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  std::vector<double> all;
  for (int32_t c = 0; c < streams; ++c) {
    all.insert(all.end(), ttft[c].begin(), ttft[c].end());
    res.tokens += tokens[c];
    res.errors += errors[c];
  }
  res.requests = static_cast<int64_t>(streams) * rounds;
  res.tokens_per_s = static_cast<double>(res.tokens) / res.seconds;
  res.ttft_p50_ms = pct(all, 0.5);
  res.ttft_p99_ms = pct(all, 0.99);
  return res;
}

// One Session, n single-token decode steps from an empty cache (`kiln bench` tg).
double single_stream_tg(const std::shared_ptr<const Model>& m, Backend& be, int32_t n) {
  Session s(m, be, n);
  const auto toks = random_tokens(n, m->n_vocab(), 1234);
  for (int pass = 0; pass < 2; ++pass) {  // pass 0 warms up
    (void)s.rollback(0);
    const auto t0 = Clock::now();
    for (int32_t id : toks) {
      const int32_t one[1] = {id};
      if (!s.eval(one, false)) std::exit(1);
    }
    if (pass == 1) return n / std::chrono::duration<double>(Clock::now() - t0).count();
  }
  return 0;
}

// Decode step time by batch width: B sessions (each with a short history) decode together
// through one BatchEval per step; widths are interleaved round by round so machine noise
// spreads over all of them. Width 0 is the baseline: one Session::eval per step. Returns
// seconds per step for each width.
std::vector<double> step_times(const std::shared_ptr<const Model>& m, Backend& be,
                               const std::vector<int32_t>& widths, int32_t n_steps) {
  std::vector<double> secs(widths.size(), 0);
  const int32_t ctx = 16 + 3 * n_steps + 8;
  for (int32_t round = 0; round < 3; ++round) {
    for (size_t wi = 0; wi < widths.size(); ++wi) {
      const int32_t w = widths[wi];
      if (w == 0) {
        Session s(m, be, ctx, 16);
        const auto p = random_tokens(16, m->n_vocab(), 500u);
        if (!s.eval(p, false)) std::exit(1);
        int32_t last = p.back();
        const auto t0 = Clock::now();
        for (int32_t k = 0; k < n_steps; ++k) {
          const int32_t one[1] = {last};
          if (!s.eval(one, false)) std::exit(1);
        }
        if (round > 0)
          secs[wi] += std::chrono::duration<double>(Clock::now() - t0).count() / n_steps / 2;
        continue;
      }
      std::vector<std::unique_ptr<Session>> ss;
      BatchEval batch(m, be, w);
      std::vector<int32_t> last(static_cast<size_t>(w));
      for (int32_t i = 0; i < w; ++i) {
        ss.push_back(std::make_unique<Session>(m, be, ctx, 16));
        const auto p = random_tokens(16, m->n_vocab(), 500u + static_cast<uint32_t>(i));
        if (!ss.back()->eval(p, false)) std::exit(1);
        last[i] = p.back();
      }
      std::vector<BatchEval::Item> items;
      for (int32_t i = 0; i < w; ++i)
        items.push_back({ss[i].get(), std::span<const int32_t>(&last[i], 1)});
      const auto t0 = Clock::now();
      for (int32_t k = 0; k < n_steps; ++k)
        if (!batch.eval(items)) std::exit(1);
      if (round > 0)
        secs[wi] += std::chrono::duration<double>(Clock::now() - t0).count() / n_steps / 2;
    }
  }
  return secs;
}

double load_average() {
  std::ifstream f("/proc/loadavg");
  double l = 0;
  f >> l;
  return l;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || argc > 11) {
    fmt::print(stderr,
               "usage: serve_bench MODEL [threads=2] [streams=1,4,16] [n_gen=64] "
               "[n_prompt=64] [rounds=2] [modes=batched,unbatched] [fast=1] "
               "[widths=0,1,2,4,8,16] [repeats=1]\n");
    return 2;
  }
  const int threads = argc > 2 ? std::atoi(argv[2]) : 2;
  const std::vector<int32_t> streams = parse_list(argc > 3 ? argv[3] : "1,4,16");
  const int32_t n_gen = argc > 4 ? std::atoi(argv[4]) : 64;
  const int32_t n_prompt = argc > 5 ? std::atoi(argv[5]) : 64;
  const int32_t rounds = argc > 6 ? std::atoi(argv[6]) : 2;
  const std::string modes = argc > 7 ? argv[7] : "batched,unbatched";
  const bool fast = argc > 8 ? std::atoi(argv[8]) != 0 : true;
  const std::vector<int32_t> widths = parse_list(argc > 9 ? argv[9] : "0,1,2,4,8,16");
  const int32_t repeats = argc > 10 ? std::atoi(argv[10]) : 1;
  if (threads < 1 || n_gen < 1 || n_prompt < 1 || rounds < 1 || streams.empty() || repeats < 1) {
    fmt::print(stderr, "serve_bench: threads, n_gen, n_prompt, rounds must be >= 1\n");
    return 2;
  }
  auto m = Model::load(argv[1]);
  if (!m) {
    fmt::print(stderr, "serve_bench: {}\n", m.error());
    return 1;
  }
  auto be = make_cpu_backend({.threads = threads, .portable_kernels = !fast});
  fmt::print("serve_bench {} threads {} prompt {} gen {} rounds {} fast {} load average {:.1f}\n",
             argv[1], threads, n_prompt, n_gen, rounds, fast ? 1 : 0, load_average());
  const double tg = single_stream_tg(*m, *be, 128);
  fmt::print("single-stream decode (Session, tg128): {:.2f} t/s\n\n", tg);
  {
    const auto secs = step_times(*m, *be, widths, 16);
    fmt::print("| decode batch width | ms per step | t/s | x Session |\n|---|---|---|---|\n");
    for (size_t i = 0; i < widths.size(); ++i) {
      const double w = std::max(widths[i], 1);
      fmt::print("| {} | {:.1f} | {:.2f} | {:.2f} |\n",
                 widths[i] ? fmt::format("{} (BatchEval)", widths[i]) : "1 (Session::eval)",
                 secs[i] * 1e3, w / secs[i], w / secs[i] * secs[0]);
    }
    fmt::print("\n");
    std::fflush(stdout);
  }
  fmt::print(
      "| streams | mode | requests | tokens | seconds | aggregate t/s | x tg128 | TTFT p50 ms | "
      "TTFT p99 ms | errors |\n");
  fmt::print("|---|---|---|---|---|---|---|---|---|---|\n");
  std::vector<std::vector<double>> ratios(streams.size());  // batched, against streams[0]
  for (int32_t pass = 0; pass < repeats; ++pass) {
    double base = 0;
    for (size_t si = 0; si < streams.size(); ++si) {
      const int32_t s = streams[si];
      for (const bool batched : {true, false}) {
        const std::string name = batched ? "batched" : "unbatched";
        if (("," + modes + ",").find("," + name + ",") == std::string::npos) continue;
        const LoadResult r = run_load(*m, *be, s, batched, n_prompt, n_gen, rounds);
        fmt::print("| {} | {} | {} | {} | {:.1f} | {:.2f} | {:.2f} | {:.0f} | {:.0f} | {} |\n", s,
                   name, r.requests, r.tokens, r.seconds, r.tokens_per_s, r.tokens_per_s / tg,
                   r.ttft_p50_ms, r.ttft_p99_ms, r.errors);
        std::fflush(stdout);
        if (!batched) continue;
        if (si == 0) base = r.tokens_per_s;
        if (base > 0) ratios[si].push_back(r.tokens_per_s / base);
      }
    }
  }
  if (repeats > 1)
    for (size_t si = 1; si < streams.size(); ++si) {
      std::vector<double> v = ratios[si];
      if (v.empty()) continue;
      std::sort(v.begin(), v.end());
      std::string all;
      for (double x : ratios[si]) all += fmt::format("{}{:.2f}", all.empty() ? "" : " ", x);
      fmt::print("batched {} streams / {} stream(s), same pass: median {:.2f} ({})\n", streams[si],
                 streams[0], v[v.size() / 2], all);
    }
  fmt::print("load average after: {:.1f}\n", load_average());
  return 0;
}
