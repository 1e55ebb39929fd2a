// backend/cuda/segment.h: the resident path's recorder (cuda_backend.h, "Resident"): each op
// is recorded with its signature, the host arrays it reads are staged into pinned memory at
// once, and the segment (the ops between two synchronisations) runs in chunks, op by op or as
// a CUDA graph captured once its chunk's signature repeats and replayed after; flush() runs
// what is left and waits. Also the device allocations that make an op resident, the pinned
// download buffer, and prefetch branches forked onto a side stream.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_util.h"
#include "core/status.h"

namespace kiln::cuda {

class Profiler;

// alloc_bytes() buffers by base address: an op whose output lies in one is resident.
class DeviceAllocs {
 public:
  bool is_dev(const void* p) const {
    const auto a = reinterpret_cast<uintptr_t>(p);
    auto it = allocs_.upper_bound(a);
    if (it == allocs_.begin()) return false;
    --it;
    return a < it->first + it->second;
  }
  void add(const void* p, size_t bytes) {
    allocs_[reinterpret_cast<uintptr_t>(p)] = bytes;
    bytes_ += bytes;
  }
  void remove(const void* p) {
    auto it = allocs_.find(reinterpret_cast<uintptr_t>(p));
    if (it != allocs_.end()) {
      bytes_ -= it->second;
      allocs_.erase(it);
    }
  }
  uint64_t bytes() const { return bytes_; }  // held now

 private:
  std::map<uintptr_t, size_t> allocs_;
  uint64_t bytes_ = 0;
};

// Callers hold the backend's mutex. The rule for every op: whatever may flush (room(),
// reserve_out(), the backend's internal scratch growth, a weight refresh, workspace growth)
// happens before its first stage(); a flush restarts staging at offset 0, so a pointer staged
// earlier in the same op would name space the next ops overwrite.
class Segment {
 public:
  Segment(const CudaOptions& opts, const Stream& compute, const DeviceAllocs& mem, Profiler& prof)
      : opts_(opts), compute_(compute), mem_(mem), prof_(prof) {}
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  // Makes this thread's current device the backend's: the runtime keeps it per thread, and
  // the backend may be called from any thread. Every op starts here: op_seq() names the op
  // being built (the expert tier keeps the slices this op has looked up, whose pointers it is
  // about to record).
  void enter() {
    use_device();
    ++op_seq_;
  }
  // The device alone, for launch_chunk(): a flush inside an op (staging room, workspace
  // growth) must leave op_seq() naming that op, or the expert tier's after_flush() would not
  // keep the slices it looked up before the flush, and a later lookup could copy another
  // slice over one the op, still pending, reads (CudaExpertTier.FlushInsideAnOpKeepsItsSlices).
  void use_device() const { check_cuda(cudaSetDevice(opts_.device), "set device"); }
  uint64_t op_seq() const { return op_seq_; }
  // flush()es so far; after_flush runs at the end of each (the expert tier's epochs, the
  // prefetch plan's cursors).
  uint64_t flushes() const { return flushes_; }
  void set_after_flush(std::function<void()> f) { after_flush_ = std::move(f); }

  // The signature: every op's kind, pointers, sizes and parameters, so two segments with equal
  // signatures do exactly the same work on the same memory.
  template <typename... A>
  void sig(const char* op, A... a) {
    key_.push_back(u64(static_cast<const void*>(op)));
    (key_.push_back(u64(a)), ...);
  }
  // Profile mode only: the name the next recorded op's time is filed under (e.g. "matmul q4_K
  // 4096x14336 x1") and the weight bytes one call reads, so a per-kernel table can state GB/s.
  void label(std::string name, uint64_t bytes = 0) {
    next_label_ = std::move(name);
    next_bytes_ = bytes;
  }
  // Appends an op (run enqueues it on the stream it is given). Graph mode launches chunks of
  // kFirstChunkOps ops growing to kChunkOps, eager mode every op; profile mode only at flush.
  void record(const char* op, std::function<cudaError_t(cudaStream_t)> run);
  // An op whose work runs on the side stream, forked from the compute stream after the ops
  // recorded before it and joined back at the end of the chunk (in a graph: a branch), so no
  // kernel of the compute stream waits for it. Needs init_branches().
  void record_branch(const char* op, std::function<cudaError_t(cudaStream_t side)> run);
  Status init_branches();  // the side stream and its fork and join events
  // The segment uses cuBLAS without a fixed workspace (GemmWorkspace::cublas_workspace null:
  // its workspace is cuBLAS's pool, which a captured graph must not name): it runs op by op.
  // Until the next launch.
  void ungraphable() { graphable_ = false; }
  // Graph mode pads an attention's key list to a bucket (row 0, position INT32_MAX: never
  // visible), so a decode step keeps its signature while the context grows within the bucket.
  size_t kv_pad(int64_t n_kv) const;

  // Makes room for `bytes` more staged bytes (an op's whole need, asked for before it stages
  // anything: a flush in between would let a later array overwrite an earlier one).
  void room(size_t bytes);
  // Bytes of host memory among the spans (what room() must hold for them).
  template <typename T>
  size_t host_bytes(std::span<const T> x, size_t pad_n = 0) const {
    if (x.empty() && pad_n == 0) return 0;
    if (!x.empty() && mem_.is_dev(x.data())) return 0;
    return std::max(x.size(), pad_n) * sizeof(T) + 16;
  }
  // Copies `bytes` of host memory into pinned staging (n_total_bytes reserved); the device
  // address they will have when the chunk runs.
  std::byte* stage(const void* host, size_t bytes, size_t n_total_bytes);
  // Device address of an int array: as is when it is device memory, else staged (padded to
  // pad_n entries of `pad`). A host array passed again unchanged in the same segment (every
  // layer's KV row list) is staged once.
  const int32_t* ints(std::span<const int32_t> h, size_t pad_n = 0, int32_t pad = 0);
  // The pinned buffer downloads land in, at least `bytes` (growing it flushes).
  void reserve_out(size_t bytes);
  std::byte* out() const { return pin_out_->data(); }

  // Launches the recorded ops (a chunk of the segment) without waiting: as a replayed graph
  // when this chunk's signature has a captured one, captured now when it was seen once before,
  // else op by op. Chunks keep the host recording the next ops while the GPU runs these.
  void launch_chunk();
  // Runs everything recorded and waits for it; staging starts over.
  void flush();
  // Graph signatures name memory by address: whoever frees or moves memory a graph may name
  // destroys them all (captured again when their chunks repeat).
  void destroy_graphs();

  uint64_t n_eager() const { return n_eager_; }
  uint64_t n_captures() const { return n_captures_; }
  uint64_t n_replays() const { return n_replays_; }
  uint64_t n_waits() const { return n_waits_; }
  double wait_ms() const { return wait_ms_; }

  static uint64_t u64(const void* p) { return reinterpret_cast<uintptr_t>(p); }
  static uint64_t u64(float f) { return std::bit_cast<uint32_t>(f); }
  template <typename T>
  requires std::is_integral_v<T> || std::is_enum_v<T>
  static uint64_t u64(T v) { return static_cast<uint64_t>(v); }

 private:
  cudaStream_t s() const { return compute_.get(); }
  cudaError_t enqueue_all(bool timed);
  // Records the pending ops (timed: with an event node around each) into a graph and
  // instantiates it in *exec (left null when the capture or instantiation is refused).
  cudaError_t capture_pending(bool timed, cudaGraphExec_t* exec);

  const CudaOptions& opts_;
  const Stream& compute_;
  const DeviceAllocs& mem_;
  Profiler& prof_;
  uint64_t op_seq_ = 0;
  uint64_t flushes_ = 0;
  std::function<void()> after_flush_;

  // Host arrays a recorded op reads go into pin_in_ at once (the caller may reuse them after
  // the call); the chunk starts with one copy of pin_in_[chunk_in_start_, in_used_) to dev_in_.
  // pin_out_ receives downloads.
  std::unique_ptr<PinnedBuffer> pin_in_, pin_out_;
  DeviceBuffer dev_in_;
  size_t in_cap_ = 0, in_used_ = 0, out_cap_ = 0;
  struct Staged {
    const void* host;
    size_t bytes, n_total;
    int32_t pad;
    size_t off;
  };
  std::vector<Staged> staged_;

  struct Pending {
    const char* op;
    std::function<cudaError_t(cudaStream_t)> run;
    std::string label;  // profile mode (label())
    uint64_t bytes = 0;
  };
  std::string next_label_;
  uint64_t next_bytes_ = 0;
  std::vector<Pending> pending_;
  std::vector<uint64_t> key_;
  bool graphable_ = true;
  struct Graph {
    cudaGraphExec_t exec = nullptr;
    bool failed = false;  // capture refused: this segment always runs eagerly
  };
  std::map<std::vector<uint64_t>, Graph> graphs_;
  // Graph mode launches a segment's first chunk after kFirstChunkOps recorded ops and each
  // later one after twice as many as the one before, up to kChunkOps, so the GPU starts on a
  // step while the host still records the rest of it (measured against a first chunk of
  // kChunkOps: docs/BENCHMARKS.md, session 34). The same ops in the same order either way.
  static constexpr size_t kChunkOps = 48, kFirstChunkOps = 8;
  size_t chunk_ops_ = kFirstChunkOps;  // the size of the chunk being recorded
  size_t chunk_in_start_ = 0;          // staging bytes before it were copied by earlier chunks
  bool launched_ = false;              // chunks launched since the last flush
  uint64_t n_eager_ = 0, n_captures_ = 0, n_replays_ = 0;
  uint64_t n_waits_ = 0;  // flush()es that waited on launched chunks, and their wall time
  double wait_ms_ = 0;

  // record_branch(): the side stream, forked from the compute stream by fork_ev_ and joined
  // back by join_ev_ at the end of the chunk; side_forked_: a branch ran since the join.
  Stream side_;
  Event fork_ev_, join_ev_;
  bool side_forked_ = false;
};

}  // namespace kiln::cuda
