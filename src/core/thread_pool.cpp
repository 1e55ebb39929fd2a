// core/thread_pool.cpp: generation-counter pool; see thread_pool.h for the contract.
#include "core/thread_pool.h"

#include <algorithm>

#include "core/check.h"

namespace kiln {
namespace {

// Waiting is staged: a few pause spins (an op takes microseconds, a futex wake tens of
// them), then yields (so an oversubscribed machine runs the thread we wait for), then sleep.
constexpr int kPauseIters = 64;
constexpr int kYieldIters = 1000;

inline void backoff(int spin) {
  if (spin < kPauseIters) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  } else {
    std::this_thread::yield();
  }
}

thread_local bool t_inside_pool = false;

}  // namespace

int ThreadPool::default_threads() {
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

ThreadPool::ThreadPool(int n_threads) {
  n_threads_ = n_threads > 0 ? n_threads : default_threads();
  workers_.reserve(static_cast<size_t>(n_threads_ - 1));
  for (int i = 1; i < n_threads_; ++i) workers_.emplace_back([this, i] { worker(i); });
}

ThreadPool::~ThreadPool() {
  stop_.store(true, std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_release);
  generation_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::run_chunk(int idx) {
  const int64_t n = n_items_, t = n_threads_;
  const int64_t begin = n * idx / t, end = n * (idx + 1) / t;
  if (begin < end) thunk_(ctx_, begin, end, idx);
}

void ThreadPool::run(int64_t n_items, void* ctx, Thunk thunk) {
  KILN_CHECK(n_items >= 0);
  if (n_items == 0) return;
  if (n_threads_ == 1 || n_items == 1 || t_inside_pool) {
    thunk(ctx, 0, n_items, 0);
    return;
  }
  std::lock_guard<std::mutex> lock(call_mu_);
  ctx_ = ctx;
  thunk_ = thunk;
  n_items_ = n_items;
  pending_.store(n_threads_ - 1, std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_release);
  generation_.notify_all();
  t_inside_pool = true;
  run_chunk(0);
  t_inside_pool = false;
  for (int spin = 0;; ++spin) {
    const int p = pending_.load(std::memory_order_acquire);
    if (p == 0) break;
    if (spin < kPauseIters + kYieldIters) {
      backoff(spin);
    } else {
      pending_.wait(p, std::memory_order_acquire);
    }
  }
}

void ThreadPool::worker(int idx) {
  t_inside_pool = true;
  // Generation 0 is the state at construction: a job posted before this thread first runs
  // is still seen as new.
  uint32_t seen = 0;
  for (;;) {
    uint32_t g = generation_.load(std::memory_order_acquire);
    for (int spin = 0; g == seen; ++spin) {
      if (spin < kPauseIters + kYieldIters) {
        backoff(spin);
      } else {
        generation_.wait(seen, std::memory_order_acquire);
      }
      g = generation_.load(std::memory_order_acquire);
    }
    seen = g;
    if (stop_.load(std::memory_order_relaxed)) return;
    run_chunk(idx);
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) pending_.notify_one();
  }
}

}  // namespace kiln
