// backend/cuda/segment.cpp: recording, staging, chunk launches (eager, captured, replayed) and
// flush() of the resident path (segment.h).
#include "backend/cuda/segment.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "backend/cuda/kernels.h"
#include "backend/cuda/profiler.h"
#include "core/check.h"
#include "core/log.h"

namespace kiln::cuda {

void Segment::record(const char* op, std::function<cudaError_t(cudaStream_t)> run) {
  pending_.push_back(Pending{op, std::move(run), std::move(next_label_), next_bytes_});
  next_label_.clear();
  next_bytes_ = 0;
  // Graph mode launches every chunk_ops_ ops (segment.h), eager mode every op; profile mode only
  // at flush.
  if (!prof_.on() && pending_.size() >= (opts_.graphs ? chunk_ops_ : 1)) launch_chunk();
}

void Segment::record_branch(const char* op, std::function<cudaError_t(cudaStream_t)> run) {
  record(op, [this, run = std::move(run)](cudaStream_t st) {
    if (cudaError_t e = cudaEventRecord(fork_ev_.get(), st); e != cudaSuccess) return e;
    if (cudaError_t e = cudaStreamWaitEvent(side_.get(), fork_ev_.get(), 0); e != cudaSuccess)
      return e;
    side_forked_ = true;
    return run(side_.get());
  });
}

Status Segment::init_branches() {
  if (cudaError_t e = side_.create(); e != cudaSuccess)
    return Status::errorf("CUDA stream: {}", cudaGetErrorString(e));
  for (Event* ev : {&fork_ev_, &join_ev_})
    if (cudaError_t e = ev->create(); e != cudaSuccess)
      return Status::errorf("CUDA event: {}", cudaGetErrorString(e));
  return Status::ok();
}

size_t Segment::kv_pad(int64_t n_kv) const {
  const int64_t bucket = opts_.graph_kv_bucket;
  if (!opts_.graphs || prof_.on() || bucket <= 1 || n_kv <= 0) return 0;
  return static_cast<size_t>((n_kv + bucket - 1) / bucket * bucket);
}

void Segment::destroy_graphs() {
  for (auto& [k, g] : graphs_)
    if (g.exec) cudaGraphExecDestroy(g.exec);
  graphs_.clear();
}

void Segment::room(size_t bytes) {
  bytes += 64 * 4;  // alignment slack of a few arrays
  if (in_used_ + bytes <= in_cap_) return;
  flush();
  if (bytes <= in_cap_) return;
  const size_t cap = std::max<size_t>(bytes * 2, size_t(1) << 20);
  destroy_graphs();  // they read the old staging
  pin_in_ = std::make_unique<PinnedBuffer>();
  check_cuda(pin_in_->allocate(cap), "pinned staging");
  dev_in_.reset();
  dev_in_.ensure(cap, "device staging");
  in_cap_ = cap;
}

std::byte* Segment::stage(const void* host, size_t bytes, size_t n_total_bytes) {
  const size_t off = (in_used_ + 15) / 16 * 16;
  KILN_CHECK(off + n_total_bytes <= in_cap_, "staging overflow: room() not called");
  if (bytes) std::memcpy(pin_in_->data() + off, host, bytes);
  in_used_ = off + n_total_bytes;
  staged_.push_back(Staged{host, bytes, n_total_bytes, 0, off});
  return static_cast<std::byte*>(dev_in_.get()) + off;
}

const int32_t* Segment::ints(std::span<const int32_t> h, size_t pad_n, int32_t pad) {
  if (h.empty() && pad_n == 0) return nullptr;
  if (!h.empty() && mem_.is_dev(h.data())) {
    KILN_CHECK(pad_n <= h.size(), "cannot pad a device array");
    return h.data();
  }
  const size_t n = std::max(h.size(), pad_n);
  for (const Staged& st : staged_)
    if (st.host == h.data() && st.bytes == h.size_bytes() && st.n_total == n * 4 && st.pad == pad &&
        std::memcmp(pin_in_->data() + st.off, h.data(), st.bytes) == 0)
      return reinterpret_cast<const int32_t*>(static_cast<std::byte*>(dev_in_.get()) + st.off);
  std::byte* d = stage(h.data(), h.size_bytes(), n * 4);
  staged_.back().pad = pad;
  auto* tail = reinterpret_cast<int32_t*>(pin_in_->data() + staged_.back().off) + h.size();
  std::fill(tail, tail + (n - h.size()), pad);
  return reinterpret_cast<const int32_t*>(d);
}

void Segment::reserve_out(size_t bytes) {
  if (bytes <= out_cap_) return;
  flush();
  destroy_graphs();
  const size_t cap = std::max<size_t>(bytes, size_t(1) << 20);
  pin_out_ = std::make_unique<PinnedBuffer>();
  check_cuda(pin_out_->allocate(cap), "pinned download buffer");
  out_cap_ = cap;
}

cudaError_t Segment::enqueue_all(bool timed) {
  // The launchers read PDL per thread: on for this backend's enqueue (off in profile mode),
  // the caller's setting restored after.
  struct SwitchScope {
    void (*set)(bool);
    bool prev;
    SwitchScope(bool (*get)(), void (*s)(bool), bool on) : set(s), prev(get()) { s(on); }
    ~SwitchScope() { set(prev); }
  };
  const SwitchScope pdl_scope(launch_pdl, set_launch_pdl, !timed);
  if (in_used_ > chunk_in_start_) {
    if (cudaError_t e = cudaMemcpyAsync(static_cast<std::byte*>(dev_in_.get()) + chunk_in_start_,
                                        pin_in_->data() + chunk_in_start_,
                                        in_used_ - chunk_in_start_, cudaMemcpyHostToDevice, s());
        e != cudaSuccess)
      return e;
  }
  side_forked_ = false;
  size_t ev = 0;
  for (const Pending& p : pending_) {
    if (timed) {
      prof_.reserve_chunk_events(ev + 2);
      // External: inside a profile capture (launch_chunk) the record becomes an event node.
      check_cuda(cudaEventRecordWithFlags(prof_.chunk_event(ev), s(), cudaEventRecordExternal),
                 "event record");
    }
    if (cudaError_t e = p.run(s()); e != cudaSuccess) return e;
    if (timed)
      check_cuda(cudaEventRecordWithFlags(prof_.chunk_event(ev + 1), s(), cudaEventRecordExternal),
                 "event record");
    ev += 2;
  }
  // The prefetch branch rejoins the compute stream (a capture must end joined): what comes
  // after this chunk also waits for its prefetch kernels, which return once their threads
  // have issued the fetches (~4 µs a launch on the H200), long before a chunk's last op.
  if (side_forked_) {
    side_forked_ = false;
    if (cudaError_t e = cudaEventRecord(join_ev_.get(), side_.get()); e != cudaSuccess) return e;
    if (cudaError_t e = cudaStreamWaitEvent(s(), join_ev_.get(), 0); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

cudaError_t Segment::capture_pending(bool timed, cudaGraphExec_t* exec) {
  cudaGraph_t graph = nullptr;
  cudaError_t e = cudaStreamBeginCapture(s(), cudaStreamCaptureModeThreadLocal);
  if (e == cudaSuccess) {
    const cudaError_t run = enqueue_all(timed);
    e = cudaStreamEndCapture(s(), &graph);
    if (run != cudaSuccess) e = run;
  }
  if (e == cudaSuccess) e = cudaGraphInstantiate(exec, graph, 0);
  if (graph) cudaGraphDestroy(graph);
  return e;
}

void Segment::launch_chunk() {
  if (pending_.empty()) return;
  use_device();
  const bool profile = prof_.on();
  bool done = false;
  if (opts_.graphs && graphable_ && !profile) {
    key_.push_back(chunk_in_start_);
    key_.push_back(in_used_);
    if (graphs_.size() > 1024) destroy_graphs();
    auto [it, fresh] = graphs_.try_emplace(key_);
    Graph& g = it->second;
    bool captured = false;
    if (!g.exec && !fresh && !g.failed) {
      const cudaError_t e = capture_pending(false, &g.exec);
      if (e != cudaSuccess) {
        cudaGetLastError();
        g.exec = nullptr;
        g.failed = true;
        log_notice("cuda: graph capture refused ({}); this segment runs op by op",
                   cudaGetErrorString(e));
      } else {
        ++n_captures_;
        captured = true;
      }
    }
    if (g.exec && !captured) ++n_replays_;
    if (g.exec) {
      check_cuda(cudaGraphLaunch(g.exec, s()), "graph launch");
      done = true;
    }
  }
  // Profile mode runs the chunk as a one-off graph with the events as nodes: the GPU then
  // runs the ops back to back as a replayed step does, so an op's time is its own and not
  // the host's launch latency (eager launches of small kernels leave the GPU waiting between
  // events). Falls back to eager launches if the capture is refused.
  if (profile && !done) {
    cudaGraphExec_t exec = nullptr;
    if (capture_pending(true, &exec) == cudaSuccess) {
      check_cuda(cudaGraphLaunch(exec, s()), "graph launch");
      check_cuda(cudaStreamSynchronize(s()), "synchronize");
      cudaGraphExecDestroy(exec);
      done = true;
      ++n_eager_;
    } else {
      cudaGetLastError();
      if (exec) cudaGraphExecDestroy(exec);
    }
  }
  if (!done) {
    check_cuda(enqueue_all(profile), pending_.front().op);
    ++n_eager_;
  }
  if (profile) {  // profile mode launches only at flush(): wait and read the events
    check_cuda(cudaStreamSynchronize(s()), "synchronize");
    size_t ev = 0;
    for (const Pending& p : pending_) {
      float ms = 0;
      check_cuda(cudaEventElapsedTime(&ms, prof_.chunk_event(ev), prof_.chunk_event(ev + 1)),
                 "event time");
      ev += 2;
      CudaOpTime& t = prof_.entry(p.label.empty() ? std::string_view(p.op) : p.label);
      t.calls += 1;
      t.kernel_ms += ms;
      t.bytes += p.bytes;
    }
  }
  pending_.clear();
  key_.clear();
  graphable_ = true;
  chunk_in_start_ = in_used_;  // later chunks copy only what they staged
  launched_ = true;
  chunk_ops_ = std::min(2 * chunk_ops_, kChunkOps);
}

void Segment::flush() {
  launch_chunk();
  if (launched_) {
    const auto t0 = std::chrono::steady_clock::now();
    check_cuda(cudaStreamSynchronize(s()), "synchronize");
    wait_ms_ +=
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    ++n_waits_;
  }
  ++flushes_;
  launched_ = false;
  chunk_ops_ = kFirstChunkOps;
  if (after_flush_) after_flush_();
  pending_.clear();
  key_.clear();
  graphable_ = true;
  in_used_ = 0;
  chunk_in_start_ = 0;
  staged_.clear();
}

}  // namespace kiln::cuda
