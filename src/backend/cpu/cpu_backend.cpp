// backend/cpu/cpu_backend.cpp: the Backend object of the cpu kernels: argument checks, the
// thread split (output rows for matmul, (query, head) pairs for attention, rows or element
// ranges elsewhere) and the scratch buffers, which only grow, so steady-state calls do not
// allocate.
#include "backend/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <mutex>
#include <numbers>
#include <string_view>
#include <vector>

#include "backend/cpu/bf16_pairs.h"
#include "backend/cpu/cpu_matmul_q8.h"
#include "backend/cpu/kernels.h"
#include "core/check.h"
#include "core/thread_pool.h"
#include "quant/quant.h"

namespace kiln {
namespace {

// Below this many multiply-adds (or elements) a call runs on the calling thread: waking the
// pool costs more than the work.
constexpr int64_t kParallelWork = 1 << 15;

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(const CpuOptions& o)
      : pool_(o.threads), portable_(o.portable_kernels), amx_(o.amx) {}
  std::string_view name() const override { return "cpu"; }

  void matmul(const WeightMatrix& w, std::span<const float> x, int64_t n_tok,
              std::span<float> y) override {
    KILN_CHECK(static_cast<int64_t>(x.size()) == n_tok * w.n_cols, "x {} != {}x{}", x.size(), n_tok,
               w.n_cols);
    KILN_CHECK(static_cast<int64_t>(y.size()) == n_tok * w.n_rows, "y {} != {}x{}", y.size(), n_tok,
               w.n_rows);
    KILN_CHECK(w.bytes.size() == w.span_bytes());
    KILN_CHECK(row_bytes(w.dtype, w.n_cols) == w.row_bytes, "{} row of {} is not {} bytes",
               dtype_name(w.dtype), w.n_cols, w.row_bytes);
    if (n_tok == 0 || w.n_rows == 0) return;
    std::lock_guard<std::mutex> lock(mu_);
    cpu::MatmulJob job;
    job.w = &w;
    job.x = x.data();
    job.n_tok = n_tok;
    job.y = y.data();
    job.portable = portable_;
    job.amx = amx_;
    const cpu::ActKind kind = cpu::act_kind(w.dtype);
    if (kind != cpu::ActKind::F32) {
      job.xq_row_bytes = cpu::act_row_bytes(kind, w.n_cols);
      grow(act_, job.xq_row_bytes * n_tok);
      std::byte* xq = act_.data();
      const size_t rb = job.xq_row_bytes;
      const int64_t n = w.n_cols;
      auto quantize = [&](int64_t b, int64_t e, int) {
        for (int64_t t = b; t < e; ++t)
          cpu::quantize_act_row(kind, x.data() + t * n, n, xq + t * rb, portable_);
      };
      if (n_tok * n >= kParallelWork)
        pool_.parallel_for(n_tok, quantize);
      else
        quantize(0, n_tok, 0);
      job.xq = xq;
    }
    const size_t per_thread = cpu::matmul_scratch_floats(w);
    float* scratch = thread_scratch(per_thread);
    auto rows = [&](int64_t b, int64_t e, int t) {
      cpu::matmul_rows(job, b, e, scratch + static_cast<size_t>(t) * per_thread);
    };
    if (w.n_rows * w.n_cols * n_tok >= kParallelWork && w.n_rows >= 2)
      pool_.parallel_for(w.n_rows, rows);
    else
      rows(0, w.n_rows, 0);
  }

  // One parallel pass over the rows of all tasks (tasks' activations encoded once per
  // distinct x). Per row this is matmul()'s arithmetic exactly: each token row is encoded by
  // the same quantize_act_row, and matmul_rows results do not depend on where a thread's
  // range starts or ends. Up to kBatchMaxTokens tokens (decode steps of a few sequences,
  // speculative verifies); a prefill's matrices are each big enough to split alone.
  static constexpr int64_t kBatchMaxTokens = 64;
  void matmul_batch(std::span<const MatmulTask> tasks, int64_t n_tok) override {
    if (tasks.size() <= 1 || n_tok < 1 || n_tok > kBatchMaxTokens) {
      for (const MatmulTask& t : tasks) matmul(*t.w, t.x, n_tok, t.y);
      return;
    }
    int64_t total_rows = 0;
    size_t act_bytes = 0, per_thread = 0;
    for (const MatmulTask& t : tasks) {
      const WeightMatrix& w = *t.w;
      KILN_CHECK(static_cast<int64_t>(t.x.size()) == n_tok * w.n_cols &&
                     static_cast<int64_t>(t.y.size()) == n_tok * w.n_rows,
                 "matmul_batch: x {} / y {} for {} tokens of a {}x{} matrix", t.x.size(),
                 t.y.size(), n_tok, w.n_rows, w.n_cols);
      KILN_CHECK(w.bytes.size() == w.span_bytes());
      KILN_CHECK(row_bytes(w.dtype, w.n_cols) == w.row_bytes);
      total_rows += w.n_rows;
      const cpu::ActKind kind = cpu::act_kind(w.dtype);
      if (kind != cpu::ActKind::F32)
        act_bytes += round64(cpu::act_row_bytes(kind, w.n_cols) * static_cast<size_t>(n_tok));
      per_thread = std::max(per_thread, cpu::matmul_scratch_floats(w));
    }
    if (total_rows == 0) return;
    std::lock_guard<std::mutex> lock(mu_);
    grow(act_, act_bytes);
    grow(batch_jobs_, tasks.size());
    size_t act_used = 0;
    for (size_t i = 0; i < tasks.size(); ++i) {
      const WeightMatrix& w = *tasks[i].w;
      cpu::MatmulJob& job = batch_jobs_[i];
      job = cpu::MatmulJob{};
      job.w = &w;
      job.x = tasks[i].x.data();
      job.n_tok = n_tok;
      job.y = tasks[i].y.data();
      job.portable = portable_;
      job.amx = amx_;
      const cpu::ActKind kind = cpu::act_kind(w.dtype);
      if (kind == cpu::ActKind::F32) continue;
      job.xq_row_bytes = cpu::act_row_bytes(kind, w.n_cols);
      size_t j = 0;  // an earlier task with the same x and encoding shares its bytes
      for (; j < i; ++j) {
        const cpu::MatmulJob& p = batch_jobs_[j];
        if (p.x == job.x && p.xq && p.xq_row_bytes == job.xq_row_bytes && p.w->n_cols == w.n_cols &&
            cpu::act_kind(p.w->dtype) == kind)
          break;
      }
      if (j < i) {
        job.xq = batch_jobs_[j].xq;
      } else {
        std::byte* xq = act_.data() + act_used;
        for (int64_t t = 0; t < n_tok; ++t)
          cpu::quantize_act_row(kind, job.x + t * w.n_cols, w.n_cols,
                                xq + static_cast<size_t>(t) * job.xq_row_bytes, portable_);
        act_used += round64(job.xq_row_bytes * static_cast<size_t>(n_tok));
        job.xq = xq;
      }
    }
    float* scratch = thread_scratch(per_thread);
    const size_t n_jobs = tasks.size();
    auto rows = [&](int64_t b, int64_t e, int t) {
      float* s = scratch + static_cast<size_t>(t) * per_thread;
      int64_t first = 0;  // global index of the current job's row 0
      for (size_t i = 0; i < n_jobs && first < e; ++i) {
        const int64_t n = batch_jobs_[i].w->n_rows;
        const int64_t lo = std::max(b, first), hi = std::min(e, first + n);
        if (lo < hi) cpu::matmul_rows(batch_jobs_[i], lo - first, hi - first, s);
        first += n;
      }
    };
    if (total_rows >= 2)
      pool_.parallel_for(total_rows, rows);
    else
      rows(0, total_rows, 0);
  }

  void get_rows(const WeightMatrix& w, std::span<const int32_t> ids,
                std::span<float> out) override {
    KILN_CHECK(out.size() == ids.size() * static_cast<size_t>(w.n_cols));
    for (int32_t id : ids) KILN_CHECK(id >= 0 && id < w.n_rows, "row id {} of {}", id, w.n_rows);
    auto body = [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i)
        quant::dequantize_row(w.dtype, w.row(ids[i]), out.subspan(i * w.n_cols, w.n_cols));
    };
    run(static_cast<int64_t>(ids.size()), static_cast<int64_t>(out.size()), body);
  }

  void rmsnorm(std::span<const float> x, std::span<const float> weight, int64_t n, float eps,
               std::span<float> y) override {
    KILN_CHECK(n > 0 && x.size() % n == 0 && y.size() == x.size());
    KILN_CHECK(weight.empty() || static_cast<int64_t>(weight.size()) == n);
    const float* wp = weight.empty() ? nullptr : weight.data();
    run(static_cast<int64_t>(x.size()) / n, static_cast<int64_t>(x.size()),
        [&](int64_t b, int64_t e, int) {
          for (int64_t r = b; r < e; ++r)
            cpu::rmsnorm_row(x.data() + r * n, wp, n, eps, y.data() + r * n);
        });
  }

  void rope(std::span<float> x, int64_t n_tok, int64_t n_head, int64_t head_dim,
            std::span<const int32_t> pos, const RopeParams& p) override {
    KILN_CHECK(static_cast<int64_t>(x.size()) == n_tok * n_head * head_dim);
    KILN_CHECK(static_cast<int64_t>(pos.size()) == n_tok);
    KILN_CHECK(p.n_rot > 0 && p.n_rot % 2 == 0 && p.n_rot <= head_dim, "n_rot {}", p.n_rot);
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t half = p.n_rot / 2;
    KILN_CHECK(p.freq_factors.empty() || static_cast<int64_t>(p.freq_factors.size()) == half,
               "{} rope factors for n_rot {}", p.freq_factors.size(), p.n_rot);
    const RopeYarnTerms yarn = rope_yarn_terms(p);
    const float mscale = yarn.mscale;
    grow(inv_freq_, static_cast<size_t>(half));
    for (int64_t i = 0; i < half; ++i) inv_freq_[i] = rope_pair_freq(p, yarn, i);
    float* scratch = thread_scratch(static_cast<size_t>(2 * half));
    auto body = [&](int64_t b, int64_t e, int t) {
      float* cs = scratch + static_cast<size_t>(t) * 2 * half;
      float* sn = cs + half;
      for (int64_t tok = b; tok < e; ++tok) {
        for (int64_t i = 0; i < half; ++i) {
          // The angle is reduced in double so large positions keep f32-accurate sin/cos.
          double th = double(pos[tok]) * inv_freq_[i];
          th -= 2 * std::numbers::pi * std::floor(th / (2 * std::numbers::pi));
          cs[i] = std::cos(static_cast<float>(th)) * mscale;
          sn[i] = std::sin(static_cast<float>(th)) * mscale;
        }
        for (int64_t h = 0; h < n_head; ++h) {
          float* v = x.data() + (tok * n_head + h) * head_dim;
          if (p.style == RopeStyle::Normal) {
            for (int64_t i = 0; i < half; ++i) {
              const float a = v[2 * i], c = v[2 * i + 1];
              v[2 * i] = a * cs[i] - c * sn[i];
              v[2 * i + 1] = a * sn[i] + c * cs[i];
            }
          } else {
            float* v1 = v + half;
            for (int64_t i = 0; i < half; ++i) {
              const float a = v[i], c = v1[i];
              v[i] = a * cs[i] - c * sn[i];
              v1[i] = a * sn[i] + c * cs[i];
            }
          }
        }
      }
    };
    if (static_cast<int64_t>(x.size()) >= kParallelWork)
      pool_.parallel_for(n_tok, body);
    else
      body(0, n_tok, 0);
  }

  void softmax(std::span<float> x, int64_t n) override {
    KILN_CHECK(n > 0 && x.size() % n == 0);
    run(static_cast<int64_t>(x.size()) / n, static_cast<int64_t>(x.size()),
        [&](int64_t b, int64_t e, int) {
          for (int64_t r = b; r < e; ++r) cpu::softmax_row(x.data() + r * n, n);
        });
  }

  void swiglu(std::span<const float> gate, std::span<const float> up,
              std::span<float> out) override {
    KILN_CHECK(gate.size() == up.size() && out.size() == up.size());
    elementwise(out.size(), [&](int64_t b, int64_t e) {
      cpu::swiglu(gate.data() + b, up.data() + b, out.data() + b, e - b);
    });
  }
  void swiglu_oai(std::span<const float> gate, std::span<const float> up, std::span<float> out,
                  float alpha, float limit) override {
    KILN_CHECK(gate.size() == up.size() && out.size() == up.size());
    elementwise(out.size(), [&](int64_t b, int64_t e) {
      cpu::swiglu_oai(gate.data() + b, up.data() + b, out.data() + b, e - b, alpha, limit);
    });
  }
  void geglu(std::span<const float> gate, std::span<const float> up,
             std::span<float> out) override {
    KILN_CHECK(gate.size() == up.size() && out.size() == up.size());
    elementwise(out.size(), [&](int64_t b, int64_t e) {
      cpu::geglu(gate.data() + b, up.data() + b, out.data() + b, e - b);
    });
  }
  void add(std::span<const float> a, std::span<const float> b, std::span<float> out) override {
    KILN_CHECK(a.size() == b.size() && out.size() == a.size());
    elementwise(out.size(), [&](int64_t s, int64_t e) {
      cpu::add(a.data() + s, b.data() + s, out.data() + s, e - s);
    });
  }
  void mul(std::span<const float> a, std::span<const float> b, std::span<float> out) override {
    KILN_CHECK(a.size() == b.size() && out.size() == a.size());
    elementwise(out.size(), [&](int64_t s, int64_t e) {
      cpu::mul(a.data() + s, b.data() + s, out.data() + s, e - s);
    });
  }
  void scale(std::span<float> x, float s) override {
    elementwise(x.size(), [&](int64_t b, int64_t e) { cpu::scale(x.data() + b, e - b, s); });
  }
  void softcap(std::span<float> x, float cap) override {
    KILN_CHECK(cap > 0);
    elementwise(x.size(), [&](int64_t b, int64_t e) { cpu::softcap(x.data() + b, e - b, cap); });
  }
  void sigmoid(std::span<float> x) override {
    elementwise(x.size(), [&](int64_t b, int64_t e) { cpu::sigmoid(x.data() + b, e - b); });
  }

  void store_rows_f16(std::span<const float> src, int64_t width, std::span<const int32_t> rows,
                      std::span<f16> plane) override {
    KILN_CHECK(width > 0 && src.size() == rows.size() * static_cast<size_t>(width));
    KILN_CHECK(plane.size() % width == 0);
    const int64_t n_phys = static_cast<int64_t>(plane.size()) / width;
    for (int32_t r : rows) KILN_CHECK(r >= 0 && r < n_phys, "row {} of {}", r, n_phys);
    run(static_cast<int64_t>(rows.size()), static_cast<int64_t>(src.size()),
        [&](int64_t b, int64_t e, int) {
          for (int64_t i = b; i < e; ++i)
            cpu::f32_to_f16(src.data() + i * width, plane.data() + rows[i] * width, width);
        });
  }

  void attention(const AttentionArgs& a) override {
    KILN_CHECK(a.n_head > 0 && a.n_head_kv > 0 && a.n_head % a.n_head_kv == 0);
    KILN_CHECK(a.head_dim > 0);
    const int64_t q_w = a.n_head * a.head_dim, kv_w = a.n_head_kv * a.head_dim;
    KILN_CHECK(static_cast<int64_t>(a.q.size()) == a.n_q * q_w);
    KILN_CHECK(a.out.size() == a.q.size());
    KILN_CHECK(static_cast<int64_t>(a.q_pos.size()) == a.n_q);
    KILN_CHECK(a.kv_pos.size() == a.kv_rows.size());
    KILN_CHECK(a.k.size() == a.v.size() && a.k.size() % kv_w == 0);
    KILN_CHECK(a.sinks.empty() || static_cast<int64_t>(a.sinks.size()) == a.n_head);
    std::lock_guard<std::mutex> lock(mu_);
    // Sinks (gpt-oss) are applied by the plain and multi-pair kernels; the grouped kernel for
    // narrow heads does not take them.
    const bool plain_only = portable_;
    const size_t per_thread = cpu::attention_scratch_floats(a.head_dim);
    float* scratch = thread_scratch(per_thread);
    const int64_t work = a.n_q * a.n_head * static_cast<int64_t>(a.kv_rows.size()) * a.head_dim;
    // Narrow heads: one task per (KV head, run of queries), the pairs in vector lanes.
    const int64_t group = a.n_head / a.n_head_kv;
    if (const int64_t tq =
            cpu::attention_group_tokens(a.head_dim, group, plain_only || !a.sinks.empty());
        tq > 0) {
      const int64_t n_runs = (a.n_q + tq - 1) / tq, tasks = a.n_head_kv * n_runs;
      auto body = [&](int64_t b, int64_t e, int t) {
        float* s = scratch + static_cast<size_t>(t) * per_thread;
        for (int64_t task = b; task < e; ++task) {
          const int64_t q0 = task % n_runs * tq;
          cpu::attention_group(a, task / n_runs, q0, std::min(a.n_q, q0 + tq), s);
        }
      };
      if (work >= kParallelWork && tasks >= 2)
        pool_.parallel_for(tasks, body);
      else
        body(0, tasks, 0);
      return;
    }
    const int64_t n_q = a.n_q;
    // Causal prefill: query i sees about i keys, so contiguous runs of queries would leave the
    // thread with the last ones three times the first's work (parallel_for gives each thread
    // one contiguous range). Taking them from both ends in turn (0, n-1, 1, n-2, ...)
    // balances the ranges; each pair's arithmetic is its own in whichever task and thread it
    // runs, so the order changes no bit.
    auto both_ends = [](int64_t k, int64_t n) { return k % 2 == 0 ? k / 2 : n - 1 - k / 2; };
    // Wide heads: one task per (KV head, run of np pairs of it), KV-head-major so that a
    // thread's consecutive tasks reread one KV head's rows (cache-resident) and not all of
    // them; within a KV head the runs from both ends.
    if (const int64_t np = cpu::attention_multi_pairs(a.head_dim, plain_only); np > 0) {
      const int64_t per_kv = n_q * group, n_runs = (per_kv + np - 1) / np;
      const int64_t tasks = a.n_head_kv * n_runs;
      auto body = [&](int64_t b, int64_t e, int t) {
        float* s = scratch + static_cast<size_t>(t) * per_thread;
        for (int64_t task = b; task < e; ++task) {
          const int64_t e0 = both_ends(task % n_runs, n_runs) * np;
          cpu::attention_multi(a, task / n_runs, e0, std::min(np, per_kv - e0), s);
        }
      };
      if (work >= kParallelWork && tasks >= 2)
        pool_.parallel_for(tasks, body);
      else
        body(0, tasks, 0);
      return;
    }
    const int64_t tasks = a.n_q * a.n_head;
    auto query_of = [&](int64_t k) { return both_ends(k, n_q); };
    auto body = [&](int64_t b, int64_t e, int t) {
      float* s = scratch + static_cast<size_t>(t) * per_thread;
      for (int64_t task = b; task < e; ++task)
        cpu::attention_one(a, query_of(task / a.n_head), task % a.n_head, s);
    };
    if (work >= kParallelWork)
      pool_.parallel_for(tasks, body);
    else
      body(0, tasks, 0);
  }

  int64_t argmax(std::span<const float> x) override {
    KILN_CHECK(!x.empty());
    int64_t best = 0;
    for (size_t i = 1; i < x.size(); ++i)
      if (x[i] > x[best]) best = static_cast<int64_t>(i);
    return best;
  }

 private:
  template <typename T>
  static void grow(std::vector<T>& v, size_t n) {
    if (v.size() < n) v.resize(n);
  }
  static size_t round64(size_t n) { return (n + 63) & ~size_t{63}; }
  // n_threads blocks of `per_thread` floats, one per pool thread index.
  float* thread_scratch(size_t per_thread) {
    grow(scratch_, per_thread * static_cast<size_t>(pool_.n_threads()));
    return scratch_.data();
  }
  // Rows split across threads when the call is big enough.
  template <typename Fn>
  void run(int64_t n_items, int64_t work, Fn&& fn) {
    if (work >= kParallelWork && n_items >= 2)
      pool_.parallel_for(n_items, fn);
    else
      fn(0, n_items, 0);
  }
  // Elementwise ranges in whole cache lines per thread.
  template <typename Fn>
  void elementwise(size_t n, Fn&& fn) {
    const int64_t n_elem = static_cast<int64_t>(n);
    if (n_elem < kParallelWork) {
      fn(0, n_elem);
      return;
    }
    constexpr int64_t kChunk = 16;
    const int64_t n_chunks = (n_elem + kChunk - 1) / kChunk;
    pool_.parallel_for(
        n_chunks, [&](int64_t b, int64_t e, int) { fn(b * kChunk, std::min(n_elem, e * kChunk)); });
  }

  ThreadPool pool_;
  const bool portable_;         // CpuOptions::portable_kernels: every op's plain kernel
  const bool amx_;              // CpuOptions::amx
  std::mutex mu_;               // guards the scratch buffers below
  std::vector<std::byte> act_;  // [n_tok][act_row_bytes]: quantized activations of a call
  std::vector<cpu::MatmulJob> batch_jobs_;  // matmul_batch: one job per task
  std::vector<float> scratch_;              // [n_threads][per-op need]
  std::vector<double> inv_freq_;            // [n_rot / 2]: rope frequencies of the current call
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(const CpuOptions& options) {
  return std::make_unique<CpuBackend>(options);
}

const char* cpu_simd_target() { return cpu::target_name(); }
bool cpu_has_amx() {
  return std::string_view(cpu::target_name()) == "AVX3_DL" && cpu::amx_usable();
}
bool cpu_bf16_pairs() {
  return std::string_view(cpu::target_name()) == "AVX3_DL" && cpu::HasAvx512Bf16();
}

}  // namespace kiln
