// core/thread_pool.h: a fixed pool of worker threads that runs one parallel_for at a time,
// splitting an item range into one contiguous chunk per thread (the caller runs chunk 0).
// No allocation per call; idle workers spin briefly and then sleep on an atomic wait, so
// back-to-back ops of a decode step do not pay a wake-up each.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace kiln {

class ThreadPool {
 public:
  // n_threads <= 0: one per hardware thread. The calling thread counts as one of them.
  explicit ThreadPool(int n_threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int n_threads() const { return n_threads_; }

  // Calls fn(begin, end, thread_idx) once per thread whose chunk of [0, n_items) is
  // non-empty and returns when all have finished. Chunks are contiguous and balanced to
  // within one item; thread_idx < n_threads() is stable for the call (index scratch by it).
  // Calls from several threads are serialised; a nested call from inside fn runs inline.
  template <typename Fn>
  void parallel_for(int64_t n_items, Fn&& fn) {
    using F = std::remove_reference_t<Fn>;
    run(n_items, const_cast<void*>(static_cast<const void*>(&fn)),
        [](void* ctx, int64_t b, int64_t e, int t) { (*static_cast<F*>(ctx))(b, e, t); });
  }

  static int default_threads();

 private:
  using Thunk = void (*)(void*, int64_t, int64_t, int);
  void run(int64_t n_items, void* ctx, Thunk thunk);
  void worker(int idx);
  void run_chunk(int idx);

  int n_threads_ = 1;
  std::vector<std::thread> workers_;
  std::mutex call_mu_;  // one parallel_for at a time
  // Job description, written by the caller before the generation bump (release) and read by
  // workers after observing it (acquire).
  void* ctx_ = nullptr;
  Thunk thunk_ = nullptr;
  int64_t n_items_ = 0;
  std::atomic<uint32_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
};

}  // namespace kiln
