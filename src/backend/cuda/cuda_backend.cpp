// backend/cuda/cuda_backend.cpp: the op table over the CUDA kernels, in two modes chosen per
// call by where the op's output lives (see cuda_backend.h):
//  - resident (output in alloc_bytes() memory): the op is recorded, not launched; host arrays
//    it reads (ids, positions, KV row lists) are copied into pinned staging at once, and the
//    recorded segment runs at the next synchronisation point (download, argmax, synchronize,
//    a host-span op, a free) after one staging copy, eagerly or as a replayed CUDA graph;
//  - host spans: the op copies its inputs to device scratch, launches, copies the outputs back
//    and synchronises (the first slice's path; tests and any caller with host memory).
// Calls are serialised by one mutex.
#include "backend/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <climits>
#include <cstring>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <mutex>
#include <numeric>
#include <optional>
#include <unordered_map>
#include <vector>

#if KILN_HAVE_NCCL
#include <nccl.h>
#endif
#include <cstdlib>

#include "backend/cuda/cuda_util.h"
#include "backend/cuda/dequant.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/weight_arena.h"
#include "backend/tier_policy.h"
#include "backend/tp_group.h"
#include "core/check.h"
#include "core/counters.h"
#include "core/log.h"

namespace kiln {

using cuda::check_cuda;

struct CudaBackend::Impl {
  explicit Impl(const CudaOptions& options) : opts(options) {}
  // Validated once, by make_cuda_backend, and read from here: every switch of the op table and
  // its rooms. Profiling (set_profile) is run-time state, not an option (profile below).
  const CudaOptions opts;
  // What CudaOptions::matmul and auto_int8_max_tokens make of a matmul: V3's kernels (V3 and
  // Auto) or V2's; the most tokens that take V3's int8 path (Auto: auto_int8_max_tokens, V3:
  // all its kernels take, more go to the V2 paths: cuBLAS); Auto's routing of F16 weights.
  cuda::MatmulKernels kernels() const {
    return opts.matmul == CudaMatmul::V2 ? cuda::MatmulKernels::V2 : cuda::MatmulKernels::V3;
  }
  int64_t int8_max_tokens() const {
    return opts.matmul == CudaMatmul::Auto ? opts.auto_int8_max_tokens : cuda::kQ8MaxTokens;
  }
  bool auto_routing() const { return opts.matmul == CudaMatmul::Auto; }
  int mma_min_tokens() const { return int(opts.int8_mma_min_tokens); }
  bool gemm_graphs() const { return opts.graphs && opts.gemm_graphs; }
#if KILN_HAVE_NCCL
  ncclComm_t comm = nullptr;  // a rank of a tensor-parallel group: owned, destroyed first
#endif
  int n_sm = 1;
  std::string device_name;
  cuda::Stream compute, copy;
  // CudaOptions::l2_prefetch_bytes (l2_prefetch.h): a hint's ranges are pulled into L2 by a
  // kernel on `side`, forked from the compute stream after the op recorded before the hint
  // and joined back at the end of the chunk (in a graph: a branch), so no kernel of the
  // compute stream waits for it. Unset: hints are ignored.
  // Safe beside the compute stream's kernels because it only reads region weights, which no
  // kernel writes and whose upload landed before the backend was made (make_cuda_backend
  // waits for it), and L2 is the device memory's point of coherence: a prefetched line is the
  // line every later load would read.
  std::optional<cuda::L2PrefetchPlan> l2_plan;
  cuda::Stream side;
  cuda::Event fork_ev, join_ev;
  bool side_forked = false;  // enqueue_all: a prefetch was launched on `side` since the join
  uint64_t l2_hints = 0, l2_bytes = 0;
  std::vector<std::span<const std::byte>> l2_named;  // prefetch_weights' scratch
  // Records a prefetch of `ranges` after the ops recorded so far. Caller holds mu.
  void record_prefetch(std::vector<cuda::PrefetchRange> ranges) {
    enter();
    ++l2_hints;
    for (const cuda::PrefetchRange& r : ranges) {
      sig("l2_prefetch", r.p, r.bytes);
      l2_bytes += r.bytes;
    }
    record("l2_prefetch", [this, ranges = std::move(ranges)](cudaStream_t st) {
      if (cudaError_t e = cudaEventRecord(fork_ev.get(), st); e != cudaSuccess) return e;
      if (cudaError_t e = cudaStreamWaitEvent(side.get(), fork_ev.get(), 0); e != cudaSuccess)
        return e;
      side_forked = true;
      return cuda::launch_l2_prefetch(ranges, side.get());
    });
  }
  static constexpr int64_t kAutoFloatMaxTokens = 8;
  cuda::GemmWorkspace gemm;  // V2's prefill path, grown on demand
  std::unique_ptr<cuda::WeightArena> arena;
  // Scratch slots, grown on demand; slot numbers are per op (an op's inputs and outputs never
  // share a slot).
  static constexpr int kSlots = 8;
  cuda::DeviceBuffer scratch[kSlots];
  std::mutex mu;

  cudaStream_t s() const { return compute.get(); }

  // Makes this thread's current device ours: the runtime keeps it per thread, and the backend
  // may be called from any thread.
  // Every op starts here: op_seq names the op being built (the expert tier keeps the slices
  // this op has looked up, whose pointers it is about to record).
  void enter() {
    check_cuda(cudaSetDevice(opts.device), "set device");
    ++op_seq;
  }
  uint64_t op_seq = 0;

  template <typename T>
  T* buffer(int slot, size_t n) {
    return static_cast<T*>(scratch[slot].ensure(std::max<size_t>(n, 1) * sizeof(T), "scratch"));
  }
  template <typename T>
  T* upload(int slot, std::span<const T> host) {
    T* d = buffer<T>(slot, host.size());
    if (!host.empty())
      check_cuda(cudaMemcpyAsync(d, host.data(), host.size_bytes(), cudaMemcpyHostToDevice, s()),
                 "copy to device");
    return d;
  }
  template <typename T>
  void download(std::span<T> host, const T* d) {
    if (!host.empty())
      check_cuda(cudaMemcpyAsync(host.data(), d, host.size_bytes(), cudaMemcpyDeviceToHost, s()),
                 "copy to host");
  }
  // Optional per-op timing (CudaOptions::profile): events 0..3 bracket the input copies, the
  // kernels and the output copies of the op in flight.
  bool profile = false;
  bool profile_events = false;  // ev[] created
  cuda::Event ev[4];
  std::vector<CudaOpTime> times;
  void mark(int i) {
    if (profile) check_cuda(cudaEventRecord(ev[i].get(), s()), "event record");
  }
  template <typename F>
  void launch(std::string_view op, F&& enqueue) {
    mark(1);
    check_cuda(enqueue(), op);
    mark(2);
  }
  void finish(std::string_view op) {
    mark(3);
    check_cuda(cudaStreamSynchronize(s()), op);
    if (!profile) return;
    float in_ms = 0, kernel_ms = 0, out_ms = 0;
    check_cuda(cudaEventElapsedTime(&in_ms, ev[0].get(), ev[1].get()), "event time");
    check_cuda(cudaEventElapsedTime(&kernel_ms, ev[1].get(), ev[2].get()), "event time");
    check_cuda(cudaEventElapsedTime(&out_ms, ev[2].get(), ev[3].get()), "event time");
    auto it =
        std::find_if(times.begin(), times.end(), [&](const CudaOpTime& t) { return t.op == op; });
    if (it == times.end()) it = times.insert(times.end(), CudaOpTime{std::string(op), 0, 0, 0});
    it->calls += 1;
    it->kernel_ms += kernel_ms;
    it->copy_ms += in_ms + out_ms;
  }

  // The kernels read rows back to back: a strided matrix (a column block) gets a compact
  // copy of its own, gathered at upload.
  const std::byte* device_weight_bytes(const WeightMatrix& w) {
    if (w.content_key != 0) return expert_device(w);
    if (w.strided()) return arena->lookup_rows(w.bytes.data(), w.row_bytes, w.stride(), w.n_rows);
    return arena->lookup(w.bytes);
  }

  // ------------------------------------------------------------------ streamed experts
  // The device tier of MoE expert streaming (issue 9): slices named by content_key, within
  // expert_cap bytes, evicted in the order of expert_policy (backend/tier_policy.h: lru, or lfu
  // by default). Two hazards decide the shape of it:
  // - The host slab a slice comes from is reused by the store for another expert once the
  //   forward pass drops its pin, which can happen before this backend launches the ops it
  //   recorded. So the copy has landed before the op that looked the slice up returns, while
  //   the caller still holds the pin: nothing reads a host slab later (never a deferred copy
  //   or a zero-copy read of it). With expert_async the op's copies are queued on the compute
  //   stream back to back and the op waits once for the last (ExpertCopyFence, at the end of
  //   matmul, matmul_batch and get_rows, the ops that look weights up), instead of waiting for
  //   each copy in turn.
  // - A device slot evicted for a new slice may still be read by recorded or running ops of
  //   the current segment. An entry used since the last flush() (epoch == flushes) is not
  //   evicted while another is left; when only such entries are left, flush() first (one
  //   synchronisation). Under lru that is the old rule exactly (the least recent entry is the
  //   first one used in the segment, if any is); lfu looks past them for the first other one.
  struct ExpertSlot {
    cuda::DeviceBuffer buf;
    size_t bytes = 0;       // the slice's
    size_t offset = 0;      // where the slice starts in buf: host address mod 256, so the
                            // kernels see the alignment the mapped (arena) copy would have
    uint64_t epoch = 0;     // flushes when last used
    uint64_t op = 0;        // op_seq when last looked up
  };
  std::unordered_map<uint64_t, ExpertSlot> experts;
  TierPolicy expert_policy{opts.expert_policy};
  std::multimap<size_t, cuda::DeviceBuffer> expert_free;  // evicted buffers, by size
  uint64_t expert_cap = 0;  // bytes; set on first use from CudaOptions::expert_cache_bytes
  uint64_t expert_held = 0, expert_hits = 0, expert_misses = 0, expert_evictions = 0;
  uint64_t expert_alloc = 0;  // device bytes of every slot buffer, live or free
  // Slices the op being built (op_seq) looked up: a flush() inside that op (cuBLAS workspace
  // growth) comes before the op is recorded, so they count as used after it.
  std::vector<uint64_t> op_keys;
  uint64_t op_keys_seq = 0;
  void note_op_use(uint64_t key) {
    if (op_keys_seq != op_seq) op_keys.clear(), op_keys_seq = op_seq;
    op_keys.push_back(key);
  }
  uint64_t expert_copied = 0;
  uint64_t flushes = 0;
  // Host ranges page-locked through register_host_memory, by start address; shared with the
  // handles' deleters, which may run after this backend is gone (an expert store's slabs).
  struct Pinned {
    std::mutex mu;
    std::map<uintptr_t, size_t> ranges;
    // True when [p, p + n) lies inside one registered range.
    bool holds(const void* p, size_t n) {
      const auto a = reinterpret_cast<uintptr_t>(p);
      std::lock_guard lk(mu);
      auto it = ranges.upper_bound(a);
      if (it == ranges.begin()) return false;
      --it;
      return a + n <= it->first + it->second;
    }
  };
  std::shared_ptr<Pinned> pinned = std::make_shared<Pinned>();
  static_assert(CudaOptions{}.mma_pre_scales == cuda::kMmaPreScalesDefault);
  static_assert(CudaOptions{}.attention_skip_empty == cuda::kAttentionSkipEmptyDefault);
  static_assert(CudaOptions{}.l2_prefetch_bytes == cuda::kL2PrefetchBytesDefault);
  static_assert(CudaOptions{}.attention_warp_tiles == cuda::kAttentionWarpTilesDefault);
  bool expert_copies_unfenced = false;  // copies queued since the last fence_expert_copies()
  cuda::Event expert_copy_ev;
  // The end of every op that looks weights up: its expert copies (queued on the compute
  // stream, ahead of every op recorded after them) have read their host slabs.
  void fence_expert_copies() {
    if (!expert_copies_unfenced) return;
    expert_copies_unfenced = false;
    check_cuda(cudaEventRecord(expert_copy_ev.get(), s()), "expert copy event");
    check_cuda(cudaEventSynchronize(expert_copy_ev.get()), "wait for expert copies");
  }

  // The process counters (`--stats`, /metrics) of the tier, looked up once.
  Counter *c_hits = nullptr, *c_misses = nullptr, *c_bytes = nullptr, *c_evictions = nullptr;
  const std::byte* expert_device(const WeightMatrix& w) {
    KILN_CHECK(!w.strided(), "cuda: a streamed expert slice cannot be strided");
    if (c_hits == nullptr) {
      CounterRegistry& r = process_counters();
      c_hits = &r.counter("moe.device_hits");
      c_misses = &r.counter("moe.device_misses");
      c_bytes = &r.counter("moe.device_bytes_copied");
      c_evictions = &r.counter("moe.device_evictions");
    }
    if (auto it = experts.find(w.content_key); it != experts.end()) {
      ExpertSlot& e = it->second;
      KILN_CHECK(e.bytes == w.bytes.size(), "cuda: expert key {:#x} names {} bytes, now {}",
                 w.content_key, e.bytes, w.bytes.size());
      expert_policy.hit(w.content_key);
      e.epoch = flushes;
      e.op = op_seq;
      note_op_use(w.content_key);
      ++expert_hits;
      c_hits->add();
      return static_cast<const std::byte*>(e.buf.get()) + e.offset;
    }
    if (expert_cap == 0) {
      size_t free_b = 0, total_b = 0;
      check_cuda(cudaMemGetInfo(&free_b, &total_b), "device memory info");
      expert_cap = opts.expert_cache_bytes ? opts.expert_cache_bytes : free_b / 2;
    }
    const size_t need = w.bytes.size();
    KILN_CHECK(need <= expert_cap, "cuda: the expert device cache ({} MiB) is smaller than one "
               "expert slice ({} MiB); raise --expert-device-cache", expert_cap >> 20, need >> 20);
    while (expert_held + need > expert_cap && expert_policy.size() > 0) {
      std::optional<uint64_t> victim =
          expert_policy.victim([&](uint64_t k) { return experts.at(k).epoch != flushes; });
      if (!victim) {
        // Every entry may be read by pending ops: run them (flushes++). The op being built
        // holds the pointers it looked up (matmul_batch of K experts): never those.
        victim = expert_policy.victim([&](uint64_t k) { return experts.at(k).op != op_seq; });
        KILN_CHECK(victim.has_value(), "cuda: the expert device cache ({} MiB) cannot hold "
                   "the experts of one op; raise --expert-device-cache", expert_cap >> 20);
        flush();
      }
      ExpertSlot& v = experts.at(*victim);
      expert_held -= v.bytes;
      ++expert_evictions;
      c_evictions->add();
      expert_free.emplace(v.buf.size(), std::move(v.buf));
      expert_policy.erase(*victim);
      experts.erase(*victim);
    }
    const size_t offset = reinterpret_cast<uintptr_t>(w.bytes.data()) % 256;
    const size_t buf_bytes = need + offset;
    cuda::DeviceBuffer buf;
    if (auto f = expert_free.lower_bound(buf_bytes); f != expert_free.end() && f->first < 2 * buf_bytes) {
      buf = std::move(f->second);
      expert_free.erase(f);
    } else {
      if (!expert_free.empty() && expert_alloc + buf_bytes > expert_cap) {
        // Free buffers of other sizes go back to the driver. Graph signatures name memory by
        // address and cudaMalloc hands freed addresses out again (see free_dev): graphs go.
        flush();
        destroy_graphs();
        for (auto& [sz, b] : expert_free) expert_alloc -= b.size();
        expert_free.clear();
      }
      buf.ensure(buf_bytes, "expert slice");
      expert_alloc += buf.size();
    }
    // Landed before the op returns (see above); from page-locked slabs
    // (ExpertStore::register_slabs) a DMA. The slot is read by no pending or running op (the
    // eviction rule above), so the copy may run ahead of the recorded ones.
    std::byte* dst = static_cast<std::byte*>(buf.get()) + offset;
    if (opts.expert_async_copies) {
      check_cuda(cudaMemcpyAsync(dst, w.bytes.data(), need, cudaMemcpyHostToDevice, s()),
                 "expert slice upload");
      expert_copies_unfenced = true;
    } else {
      check_cuda(cudaMemcpy(dst, w.bytes.data(), need, cudaMemcpyHostToDevice),
                 "expert slice upload");
    }
    expert_policy.insert(w.content_key);
    ExpertSlot& e = experts[w.content_key];
    e.buf = std::move(buf);
    e.bytes = need;
    e.offset = offset;
    e.epoch = flushes;
    e.op = op_seq;
    note_op_use(w.content_key);
    expert_held += need;
    expert_copied += need;
    ++expert_misses;
    c_misses->add();
    c_bytes->add(need);
    return static_cast<const std::byte*>(e.buf.get()) + offset;
  }
  cuda::DeviceWeight weight(const WeightMatrix& w) {
    KILN_CHECK(cuda::cuda_supports(w.dtype), "cuda: weight type {} has no kernel",
               dtype_name(w.dtype));
    KILN_CHECK(w.bytes.size() == w.span_bytes(), "weight bytes {} != {} rows of {} (stride {})",
               w.bytes.size(), w.n_rows, w.row_bytes, w.stride());
    cuda::DeviceWeight d{w.dtype, w.n_cols, w.n_rows, w.row_bytes, nullptr};
    d.data = device_weight_bytes(w);
    // Kernels on the compute stream must not read the weight before its upload lands.
    check_cuda(cudaStreamWaitEvent(s(), arena->ready(), 0), "wait for weight upload");
    return d;
  }


  // ------------------------------------------------------------------ resident mode
  // alloc_bytes() buffers by base address: an op whose output lies in one is resident.
  std::map<uintptr_t, size_t> allocs;
  uint64_t device_bytes = 0;
  bool is_dev(const void* p) const {
    const auto a = reinterpret_cast<uintptr_t>(p);
    auto it = allocs.upper_bound(a);
    if (it == allocs.begin()) return false;
    --it;
    return a < it->first + it->second;
  }

  // Host arrays a recorded op reads go into pin_in at once (the caller may reuse them after
  // the call); the segment starts with one copy of pin_in[0, in_used) to dev_in. A host
  // array passed again unchanged in the same segment (every layer's KV row list) is staged
  // once. pin_out receives downloads.
  std::unique_ptr<cuda::PinnedBuffer> pin_in, pin_out;
  cuda::DeviceBuffer dev_in;
  size_t in_cap = 0, in_used = 0, out_cap = 0;
  struct Staged {
    const void* host;
    size_t bytes, n_total;
    int32_t pad;
    size_t off;
  };
  std::vector<Staged> staged;

  // The recorded segment and its signature: every op's kind, pointers, sizes and parameters,
  // so two segments with equal signatures do exactly the same work on the same memory.
  struct Pending {
    const char* op;
    std::function<cudaError_t(cudaStream_t)> run;
    // Profile mode only: the name the op's time is filed under (e.g. "matmul q4_K 4096x14336
    // x1") and the weight bytes one call reads, so a per-kernel table can state GB/s.
    std::string label;
    uint64_t bytes = 0;
  };
  std::string next_label;  // profile mode: set by an op just before record()
  uint64_t next_bytes = 0;
  std::vector<Pending> pending;
  std::vector<uint64_t> key;
  // false once the segment uses cuBLAS without CudaOptions::gemm_graphs (its workspace is
  // then cuBLAS's own pool, which a captured graph must not name)
  bool graphable = true;
  // Graph mode pads an attention's key list to a bucket (row 0, position INT32_MAX: never
  // visible), so a decode step keeps its signature while the context grows within the bucket.
  size_t kv_pad(int64_t n_kv) const {
    const int64_t bucket = opts.graph_kv_bucket;
    if (!opts.graphs || profile || bucket <= 1 || n_kv <= 0) return 0;
    return static_cast<size_t>((n_kv + bucket - 1) / bucket * bucket);
  }
  struct Graph {
    cudaGraphExec_t exec = nullptr;
    bool failed = false;  // capture refused: this segment always runs eagerly
  };
  std::map<std::vector<uint64_t>, Graph> graphs;
  uint64_t n_eager = 0, n_captures = 0, n_replays = 0;
  uint64_t n_waits = 0;  // flush()es that waited on launched chunks, and their wall time
  double wait_ms = 0;
  uint64_t uploads_seen = 0;  // arena uploads known to have landed
  std::deque<cuda::Event> prof_events;  // profile mode: two per pending op
  cuda::DeviceBuffer attn_part, argmax_out;
  cuda::DeviceBuffer topk_v, topk_i;  // top_k's passes and result
  size_t topk_v_cap = 0, topk_i_cap = 0;
  cuda::DeviceBuffer act_q8;  // MatmulKernels::V3's quantized activations
  size_t act_q8_cap = 0;
  // V3: the activation scratch for this matmul (null when the int8 path does not apply).
  std::byte* v3_act(const cuda::DeviceWeight& w, int64_t n_tok, size_t* bytes) {
    *bytes = cuda::matvec_q8_supports(w.dtype) && n_tok <= int8_max_tokens()
                 ? cuda::act_q8_bytes(w.n_cols, n_tok)
                 : 0;
    return *bytes ? internal<std::byte>(act_q8, *bytes, act_q8_cap) : nullptr;
  }
  // V2 and V3 take the cuBLAS path above 16 tokens, except V3's int8 path (up to 64).
  bool wants_gemm(cuda::MatmulKernels k, const cuda::DeviceWeight& w, int64_t n_tok) const {
    // Auto: F16 weights above V3's float kernel (8 tokens) go to cuBLAS, which reads them in
    // place; V2's f32-activation matvec read them at 140-380 GB/s at 16 tokens.
    if (auto_routing() && w.dtype == DType::F16 && n_tok > kAutoFloatMaxTokens) return true;
    if (n_tok <= cuda::kMatvecMaxTokens) return false;
    return !(k == cuda::MatmulKernels::V3 && cuda::matvec_q8_supports(w.dtype) &&
             n_tok <= int8_max_tokens());
  }

  // rope() and rope_qk() on resident memory (k null, n_head_k 0 for one tensor): one launch
  // of the rope kernel, which serves both (rope.cu). Caller holds mu.
  void record_rope(float* q, int64_t n_head_q, float* k, int64_t n_head_k, int64_t n_tok,
                   int64_t head_dim, std::span<const int32_t> pos, const RopeParams& p) {
    enter();
    room(host_bytes(pos));
    const int32_t* dpos = ints(pos);
    const RopeParams rp = p;
    const bool neox = p.style == RopeStyle::NeoX;
    sig("rope", q, n_head_q, k, n_head_k, n_tok, head_dim, dpos, rp.n_rot, rp.freq_base,
        rp.freq_scale, neox);
    record("rope", [=](cudaStream_t st) {
      return cuda::launch_rope_qk(q, n_head_q, k, n_head_k, n_tok, head_dim, dpos, rp.n_rot,
                                  rp.freq_base, rp.freq_scale, neox, st);
    });
  }

  static uint64_t u64(const void* p) { return reinterpret_cast<uintptr_t>(p); }
  static uint64_t u64(float f) { return std::bit_cast<uint32_t>(f); }
  template <typename T>
    requires std::is_integral_v<T> || std::is_enum_v<T>
  static uint64_t u64(T v) {
    return static_cast<uint64_t>(v);
  }
  template <typename... A>
  void sig(const char* op, A... a) {
    key.push_back(u64(static_cast<const void*>(op)));
    (key.push_back(u64(a)), ...);
  }
  void record(const char* op, std::function<cudaError_t(cudaStream_t)> run) {
    pending.push_back(Pending{op, std::move(run), std::move(next_label), next_bytes});
    next_label.clear();
    next_bytes = 0;
    // Graph mode launches every kChunkOps ops, eager mode every op; profile mode only at flush.
    if (!profile && pending.size() >= (opts.graphs ? kChunkOps : 1)) launch_chunk();
  }
  static constexpr size_t kChunkOps = 48;
  size_t chunk_in_start = 0;  // staging bytes before it were copied by earlier chunks

  void destroy_graphs() {
    for (auto& [k, g] : graphs)
      if (g.exec) cudaGraphExecDestroy(g.exec);
    graphs.clear();
  }

  // Makes room for `bytes` more staged bytes (an op's whole need, asked for before it stages
  // anything: a flush in between would let a later array overwrite an earlier one). Rule for
  // every op: whatever may flush (room, internal, reserve_out, weight refresh, workspace
  // growth) happens before its first stage(); a flush restarts staging at offset 0, so a
  // pointer staged earlier in the same op would name space the next ops overwrite.
  void room(size_t bytes) {
    bytes += 64 * 4;  // alignment slack of a few arrays
    if (in_used + bytes <= in_cap) return;
    flush();
    if (bytes <= in_cap) return;
    const size_t cap = std::max<size_t>(bytes * 2, size_t(1) << 20);
    destroy_graphs();  // they read the old staging
    pin_in = std::make_unique<cuda::PinnedBuffer>();
    check_cuda(pin_in->allocate(cap), "pinned staging");
    dev_in.reset();
    dev_in.ensure(cap, "device staging");
    in_cap = cap;
  }
  // Bytes of host memory among the spans (what room() must hold for them).
  template <typename T>
  size_t host_bytes(std::span<const T> x, size_t pad_n = 0) const {
    if (x.empty() && pad_n == 0) return 0;
    if (!x.empty() && is_dev(x.data())) return 0;
    return std::max(x.size(), pad_n) * sizeof(T) + 16;
  }
  std::byte* stage(const void* host, size_t bytes, size_t n_total_bytes) {
    const size_t off = (in_used + 15) / 16 * 16;
    KILN_CHECK(off + n_total_bytes <= in_cap, "staging overflow: room() not called");
    if (bytes) std::memcpy(pin_in->data() + off, host, bytes);
    in_used = off + n_total_bytes;
    staged.push_back(Staged{host, bytes, n_total_bytes, 0, off});
    return static_cast<std::byte*>(dev_in.get()) + off;
  }
  // Device address of an int array: as is when it is device memory, else staged (padded to
  // pad_n entries of `pad`).
  const int32_t* ints(std::span<const int32_t> h, size_t pad_n = 0, int32_t pad = 0) {
    if (h.empty() && pad_n == 0) return nullptr;
    if (!h.empty() && is_dev(h.data())) {
      KILN_CHECK(pad_n <= h.size(), "cannot pad a device array");
      return h.data();
    }
    const size_t n = std::max(h.size(), pad_n);
    for (const Staged& st : staged)
      if (st.host == h.data() && st.bytes == h.size_bytes() && st.n_total == n * 4 &&
          st.pad == pad && std::memcmp(pin_in->data() + st.off, h.data(), st.bytes) == 0)
        return reinterpret_cast<const int32_t*>(static_cast<std::byte*>(dev_in.get()) + st.off);
    std::byte* d = stage(h.data(), h.size_bytes(), n * 4);
    staged.back().pad = pad;
    auto* tail = reinterpret_cast<int32_t*>(pin_in->data() + staged.back().off) + h.size();
    std::fill(tail, tail + (n - h.size()), pad);
    return reinterpret_cast<const int32_t*>(d);
  }
  // Device address of a read-only float input: device memory as is, weights (norm weights,
  // biases) from the arena, any other host array staged.
  bool cached_floats(std::span<const std::byte> b) const {
    const std::span<const std::byte> immutable = opts.immutable_region;
    return arena->holds(b) ||
           (!immutable.empty() && b.data() >= immutable.data() &&
            b.data() + b.size() <= immutable.data() + immutable.size());
  }
  const float* floats(std::span<const float> h) {
    if (h.empty()) return nullptr;
    if (is_dev(h.data())) return h.data();
    const auto b = std::as_bytes(h);
    if (cached_floats(b)) {
      const auto* d = reinterpret_cast<const float*>(arena->lookup(b));
      weights_ready();  // a first use uploads on the copy stream
      return d;
    }
    return reinterpret_cast<const float*>(stage(h.data(), h.size_bytes(), h.size_bytes()));
  }
  size_t float_room(std::span<const float> h) const {
    if (h.empty() || is_dev(h.data()) || cached_floats(std::as_bytes(h))) return 0;
    return h.size_bytes() + 16;
  }
  // Arena uploads run on the copy stream; a recorded op must not read a weight before its
  // upload landed. Waiting on the host here (only after new uploads) keeps cross-stream
  // waits out of captured graphs.
  void weights_ready() {
    const uint64_t u = arena->stats().uploads;
    if (u == uploads_seen) return;
    check_cuda(cudaEventSynchronize(arena->ready()), "wait for weight upload");
    uploads_seen = u;
  }
  // The resident rmsnorm (add_to null) or add_rmsnorm (add_to: the device rows x that `in`
  // is added to, in place): `in` and the weight staged or cached, one recorded launch.
  void record_norm(std::span<const float> in, float* add_to, std::span<const float> weight,
                   int64_t n, float eps, float* dy) {
    enter();
    room(float_room(in) + float_room(weight));
    const float* din = floats(in);
    const float* dw = floats(weight);
    weights_ready();
    const int64_t rows = static_cast<int64_t>(in.size()) / n;
    const char* op = add_to ? "add_rmsnorm" : "rmsnorm";
    sig(op, add_to, din, dw, rows, n, eps, dy);
    record(op, [=](cudaStream_t st) {
      return add_to ? cuda::launch_add_rmsnorm(add_to, din, dw, rows, n, eps, dy, st)
                    : cuda::launch_rmsnorm(din, dw, rows, n, eps, dy, st);
    });
  }
  cuda::DeviceWeight weight_resident(const WeightMatrix& w) {
    KILN_CHECK(cuda::cuda_supports(w.dtype), "cuda: weight type {} has no kernel",
               dtype_name(w.dtype));
    KILN_CHECK(w.bytes.size() == w.span_bytes(), "weight bytes {} != {} rows of {} (stride {})",
               w.bytes.size(), w.n_rows, w.row_bytes, w.stride());
    // verify mode (tests) may refresh a cached weight in place: pending ops must read the
    // bytes they were recorded with.
    if (opts.verify_weight_cache && w.content_key == 0 && !arena->holds(w.bytes)) flush();
    cuda::DeviceWeight d{w.dtype, w.n_cols, w.n_rows, w.row_bytes, nullptr};
    d.data = device_weight_bytes(w);
    weights_ready();
    if (l2_plan) l2_plan->consumed(d.data);
    return d;
  }
  // CudaOptions::f16_cache_bytes: f16 copies of region weights for the cuBLAS path, by the
  // weight's device address. The region's bytes never change while the backend lives (the
  // GGUF mapping is read-only; verify mode refreshes only weights outside it, see
  // weight_resident), so a copy written once stays the weight's dequantization; copies are
  // freed with the backend only, so no graph ever names a freed one.
  std::unordered_map<const std::byte*, cuda::DeviceBuffer> f16_cache;
  uint64_t f16_cache_cap = 0, f16_cache_used = 0;
  bool f16_cache_capped = false;
  // The weight as the cuBLAS path should read it: its f16 copy (recording the one
  // dequantization into it on first use, ahead of the caller's op in stream order) when the
  // cache takes it, else dw itself. Records an op: call before the caller's staging.
  cuda::DeviceWeight f16_cached(const WeightMatrix& w, const cuda::DeviceWeight& dw) {
    if (opts.f16_cache_bytes == 0 || dw.dtype == DType::F16 || w.content_key != 0 || w.strided() ||
        !arena->holds(w.bytes))
      return dw;
    const size_t bytes = size_t(dw.n_rows) * size_t(dw.n_cols) * sizeof(uint16_t);
    auto it = f16_cache.find(dw.data);
    if (it == f16_cache.end()) {
      if (!f16_cache_capped) {
        f16_cache_capped = true;
        f16_cache_cap = opts.f16_cache_bytes;
        if (opts.f16_cache_bytes == CudaOptions::kF16CacheAuto) {
          size_t free_b = 0, total_b = 0;
          f16_cache_cap = cudaMemGetInfo(&free_b, &total_b) == cudaSuccess ? free_b / 4 : 0;
        }
      }
      if (f16_cache_used + bytes > f16_cache_cap) return dw;
      cuda::DeviceBuffer buf;
      if (!buf.try_ensure(bytes)) {
        f16_cache_cap = f16_cache_used;  // the device is full: take no more
        return dw;
      }
      f16_cache_used += bytes;
      void* out = buf.get();
      it = f16_cache.emplace(dw.data, std::move(buf)).first;
      sig("f16_cache", dw.data, out);
      if (profile) {
        next_label = fmt::format("f16 cache copy {} {}x{}", dtype_name(dw.dtype), dw.n_cols,
                                 dw.n_rows);
        next_bytes = uint64_t(dw.row_bytes) * uint64_t(dw.n_rows);
      }
      record("f16_cache", [=](cudaStream_t st) { return cuda::launch_dequant_f16(dw, out, st); });
    }
    return cuda::DeviceWeight{DType::F16, dw.n_cols, dw.n_rows,
                              size_t(dw.n_cols) * sizeof(uint16_t),
                              static_cast<const std::byte*>(it->second.get())};
  }
  // Grow-only internal device scratch; growing moves it, so pending ops run first and graphs
  // that read the old one go.
  template <typename T>
  T* internal(cuda::DeviceBuffer& b, size_t n, size_t& cap) {
    const size_t bytes = std::max<size_t>(n, 1) * sizeof(T);
    if (bytes > cap || !b.get()) {
      flush();
      destroy_graphs();
      b.reset();
      cap = std::max(bytes, cap * 2);
      b.ensure(cap, "scratch");
    }
    return static_cast<T*>(b.get());
  }
  size_t attn_cap = 0, argmax_cap = 0;
  void reserve_out(size_t bytes) {
    if (bytes <= out_cap) return;
    flush();
    destroy_graphs();
    const size_t cap = std::max<size_t>(bytes, size_t(1) << 20);
    pin_out = std::make_unique<cuda::PinnedBuffer>();
    check_cuda(pin_out->allocate(cap), "pinned download buffer");
    out_cap = cap;
  }

  cudaError_t enqueue_all(bool timed) {
    // The launchers read their switches (PDL, the tensor-core kernel's pre-decoded scales) per
    // thread: this backend's settings for this enqueue only, the caller's restored after.
    struct SwitchScope {
      void (*set)(bool);
      bool prev;
      SwitchScope(bool (*get)(), void (*s)(bool), bool on) : set(s), prev(get()) { s(on); }
      ~SwitchScope() { set(prev); }
    };
    const SwitchScope pdl_scope(cuda::launch_pdl, cuda::set_launch_pdl, opts.pdl && !timed);
    const SwitchScope pre_scales_scope(cuda::mma_pre_scales, cuda::set_mma_pre_scales,
                                       opts.mma_pre_scales);
    const SwitchScope skip_empty_scope(cuda::attention_skip_empty,
                                       cuda::set_attention_skip_empty, opts.attention_skip_empty);
    if (in_used > chunk_in_start) {
      if (cudaError_t e = cudaMemcpyAsync(static_cast<std::byte*>(dev_in.get()) + chunk_in_start,
                                          pin_in->data() + chunk_in_start,
                                          in_used - chunk_in_start, cudaMemcpyHostToDevice, s());
          e != cudaSuccess)
        return e;
    }
    side_forked = false;
    size_t ev = 0;
    for (const Pending& p : pending) {
      if (timed) {
        while (prof_events.size() < ev + 2) {
          prof_events.emplace_back();
          check_cuda(prof_events.back().create(/*timing=*/true), "event");
        }
        // External: inside a profile capture (launch_chunk) the record becomes an event node.
        check_cuda(cudaEventRecordWithFlags(prof_events[ev].get(), s(), cudaEventRecordExternal),
                   "event record");
      }
      if (cudaError_t e = p.run(s()); e != cudaSuccess) return e;
      if (timed)
        check_cuda(
            cudaEventRecordWithFlags(prof_events[ev + 1].get(), s(), cudaEventRecordExternal),
            "event record");
      ev += 2;
    }
    // The prefetch branch rejoins the compute stream (a capture must end joined): what comes
    // after this chunk also waits for its prefetch kernels, which return once their threads
    // have issued the fetches (~4 µs a launch on the H200), long before a chunk's last op.
    if (side_forked) {
      side_forked = false;
      if (cudaError_t e = cudaEventRecord(join_ev.get(), side.get()); e != cudaSuccess) return e;
      if (cudaError_t e = cudaStreamWaitEvent(s(), join_ev.get(), 0); e != cudaSuccess) return e;
    }
    return cudaSuccess;
  }

  // Records the pending ops (timed: with an event node around each) into a graph and
  // instantiates it in *exec (left null when the capture or instantiation is refused).
  cudaError_t capture_pending(bool timed, cudaGraphExec_t* exec) {
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

  // Launches the recorded ops (a chunk of the segment) without waiting: as a replayed graph
  // when this chunk's signature has a captured one, captured now when it was seen once before,
  // else op by op. Chunks keep the host recording the next ops while the GPU runs these.
  void launch_chunk() {
    if (pending.empty()) return;
    enter();
    bool done = false;
    if (opts.graphs && graphable && !profile) {
      key.push_back(chunk_in_start);
      key.push_back(in_used);
      if (graphs.size() > 1024) destroy_graphs();
      auto [it, fresh] = graphs.try_emplace(key);
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
          ++n_captures;
          captured = true;
        }
      }
      if (g.exec && !captured) ++n_replays;
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
        ++n_eager;
      } else {
        cudaGetLastError();
        if (exec) cudaGraphExecDestroy(exec);
      }
    }
    if (!done) {
      check_cuda(enqueue_all(profile), pending.front().op);
      ++n_eager;
    }
    if (profile) {  // profile mode launches only at flush(): wait and read the events
      check_cuda(cudaStreamSynchronize(s()), "synchronize");
      size_t ev = 0;
      for (const Pending& p : pending) {
        float ms = 0;
        check_cuda(cudaEventElapsedTime(&ms, prof_events[ev].get(), prof_events[ev + 1].get()),
                   "event time");
        ev += 2;
        const std::string_view name = p.label.empty() ? std::string_view(p.op) : p.label;
        auto it = std::find_if(times.begin(), times.end(),
                               [&](const CudaOpTime& t) { return t.op == name; });
        if (it == times.end())
          it = times.insert(times.end(), CudaOpTime{std::string(name), 0, 0, 0});
        it->calls += 1;
        it->kernel_ms += ms;
        it->bytes += p.bytes;
      }
    }
    pending.clear();
    key.clear();
    graphable = true;
    chunk_in_start = in_used;  // later chunks copy only what they staged
    launched = true;
  }
  bool launched = false;  // chunks launched since the last flush
  // Runs everything recorded and waits for it; staging starts over.
  void flush() {
    launch_chunk();
    if (launched) {
      const auto t0 = std::chrono::steady_clock::now();
      check_cuda(cudaStreamSynchronize(s()), "synchronize");
      wait_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                     .count();
      ++n_waits;
    }
    ++flushes;
    if (op_keys_seq == op_seq)
      for (uint64_t k : op_keys)
        if (auto it = experts.find(k); it != experts.end()) it->second.epoch = flushes;
    launched = false;
    if (l2_plan) l2_plan->reset();
    pending.clear();
    key.clear();
    graphable = true;
    in_used = 0;
    chunk_in_start = 0;
    staged.clear();
  }
  void free_dev(std::byte* p) {
    std::lock_guard lock(mu);
    enter();
    flush();  // pending ops may still use it
    auto it = allocs.find(u64(p));
    if (it != allocs.end()) {
      device_bytes -= it->second;
      allocs.erase(it);
    }
    // Graph signatures name memory by address, and the allocator hands a freed address out
    // again: a captured graph whose nodes name this buffer would match a later segment over a
    // different allocation at the same address and replay against the freed one (a memcpy
    // node then fails: cudaErrorInvalidValue at launch, seen on a GPU prefill node whose KV
    // planes grow while kvpack tiles are downloaded). Frees are rare in steady decode (KV
    // growth doubles, scratch is kept), so every graph goes and is captured again.
    destroy_graphs();
    cudaFree(p);
  }
  // A host-span op: whatever is recorded runs first, and no argument may be device memory
  // (that would need the resident path, chosen by the output).
  void begin_host_op(std::initializer_list<const void*> inputs, std::string_view op) {
    enter();
    flush();
    for (const void* p : inputs)
      KILN_CHECK(!p || !is_dev(p), "cuda {}: device input with a host output", op);
    mark(0);
  }

  // Elementwise binary op on host spans.
  void binary(std::span<const float> a, std::span<const float> b, std::span<float> out,
              cuda::Binary op, std::string_view name) {
    KILN_CHECK(a.size() == b.size() && out.size() == a.size(), "{}: sizes {} {} {}", name, a.size(),
               b.size(), out.size());
    std::lock_guard lock(mu);
    if (is_dev(out.data())) {
      enter();
      room(float_room(a) + float_room(b));
      const float *da = floats(a), *db = floats(b);
      float* dout = out.data();
      const auto n = static_cast<int64_t>(out.size());
      sig(name.data(), da, db, dout, n, op);
      record(name.data(), [=](cudaStream_t st) { return cuda::launch_binary(da, db, dout, n, op, st); });
      return;
    }
    begin_host_op({a.data(), b.data()}, name);
    const float* da = upload<float>(0, a);
    const float* db = upload<float>(1, b);
    float* dout = buffer<float>(2, out.size());
    launch(name, [&] {
      return cuda::launch_binary(da, db, dout, static_cast<int64_t>(out.size()), op, s());
    });
    download(out, static_cast<const float*>(dout));
    finish(name);
  }
  void unary(std::span<float> x, cuda::Unary op, float param, std::string_view name) {
    std::lock_guard lock(mu);
    if (is_dev(x.data())) {
      float* dx = x.data();
      const auto n = static_cast<int64_t>(x.size());
      sig(name.data(), dx, n, op, param);
      record(name.data(), [=](cudaStream_t st) { return cuda::launch_unary(dx, n, op, param, st); });
      return;
    }
    begin_host_op({}, name);
    float* dx = upload<float>(0, std::span<const float>(x));
    launch(name,
           [&] { return cuda::launch_unary(dx, static_cast<int64_t>(x.size()), op, param, s()); });
    download(x, static_cast<const float*>(dx));
    finish(name);
  }
};

CudaBackend::CudaBackend(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

CudaBackend::~CudaBackend() {
  if (impl_) {
    cudaSetDevice(impl_->opts.device);
    {
      std::lock_guard lock(impl_->mu);
      impl_->flush();
      impl_->destroy_graphs();
    }
    cudaStreamSynchronize(impl_->compute.get());
#if KILN_HAVE_NCCL
    if (impl_->comm) ncclCommDestroy(impl_->comm);
#endif
    impl_->arena.reset();  // before its streams go
  }
}

// Declared after the op's lock: on every return the op's expert copies have read their host
// slabs before the caller may drop the pins (Impl::expert_device).
struct ExpertCopyFence {
  CudaBackend::Impl& impl;
  ~ExpertCopyFence() { impl.fence_expert_copies(); }
};

const std::string& CudaBackend::device_name() const { return impl_->device_name; }

void CudaBackend::prefetch_weights(std::span<const WeightMatrix* const> ws, int64_t n_tok) {
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  // Only one-token steps (kL2PrefetchMaxTokens: one token always takes a matvec kernel, which
  // reads the weight's own bytes in place), the K-quants (l2_prefetch_type), and only region
  // weights: not a streamed expert (its slot may not be filled yet), a gathered column block,
  // nor weights mapped from host memory (zero-copy: over PCIe).
  if (!I.l2_plan || I.arena->stats().zero_copy || n_tok > cuda::kL2PrefetchMaxTokens) return;
  I.l2_named.clear();
  for (const WeightMatrix* w : ws) {
    if (w == nullptr || w->n_rows == 0 || w->content_key != 0 || w->strided() ||
        !cuda::l2_prefetch_type(w->dtype) || !I.arena->holds(w->bytes))
      continue;
    I.l2_named.emplace_back(I.arena->lookup(w->bytes), w->bytes.size());  // an offset: holds()
  }
  std::vector<cuda::PrefetchRange> ranges = I.l2_plan->hint(I.l2_named);
  if (!ranges.empty()) I.record_prefetch(std::move(ranges));
}

void CudaBackend::set_profile(bool on) {
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  I.enter();
  I.flush();  // what was recorded so far runs in the old mode
  if (on && !I.profile_events) {
    for (cuda::Event& e : I.ev) check_cuda(e.create(/*timing=*/true), "event");
    I.profile_events = true;
  }
  I.profile = on;
  I.times.clear();
}

CudaStats CudaBackend::stats() const {
  const cuda::ArenaStats& a = impl_->arena->stats();
  CudaStats st;
  st.weight_bytes_uploaded = a.bytes_uploaded;
  st.weight_uploads = a.uploads;
  st.weight_cache_hits = a.cache_hits;
  st.arena_bytes = a.arena_bytes;
  st.upload_seconds = a.upload_seconds;
  st.zero_copy = a.zero_copy;
  st.ops = impl_->times;
  st.segments_eager = impl_->n_eager;
  st.graph_captures = impl_->n_captures;
  st.graph_replays = impl_->n_replays;
  st.segment_waits = impl_->n_waits;
  st.segment_wait_ms = impl_->wait_ms;
  st.device_bytes = impl_->device_bytes;
  st.expert_hits = impl_->expert_hits;
  st.expert_misses = impl_->expert_misses;
  st.expert_evictions = impl_->expert_evictions;
  st.expert_bytes_copied = impl_->expert_copied;
  st.expert_bytes_held = impl_->expert_held;
  st.expert_cache_bytes = impl_->expert_cap;
  st.f16_cache_weights = impl_->f16_cache.size();
  st.f16_cache_bytes = impl_->f16_cache_used;
  st.f16_cache_cap = impl_->f16_cache_cap;
  st.l2_prefetch_hints = impl_->l2_hints;
  st.l2_prefetch_bytes = impl_->l2_bytes;
  return st;
}

std::shared_ptr<void> CudaBackend::register_host_memory(std::span<std::byte> mem) {
  if (mem.empty()) return nullptr;
  void* p = mem.data();
  if (cudaError_t e = cudaHostRegister(p, mem.size(), cudaHostRegisterPortable); e != cudaSuccess) {
    cudaGetLastError();
    log_notice("cuda: could not page-lock {} MiB of host memory ({}); copies read pageable "
               "memory", mem.size() >> 20, cudaGetErrorString(e));
    return nullptr;
  }
  std::shared_ptr<Impl::Pinned> pinned = impl_->pinned;
  {
    std::lock_guard lk(pinned->mu);
    pinned->ranges[reinterpret_cast<uintptr_t>(p)] = mem.size();
  }
  // cudaHostUnregister is synchronous; the owner releases this before freeing the memory.
  return std::shared_ptr<void>(p, [pinned](void* q) {
    {
      std::lock_guard lk(pinned->mu);
      pinned->ranges.erase(reinterpret_cast<uintptr_t>(q));
    }
    cudaHostUnregister(q);
    cudaGetLastError();
  });
}

BackendBytes CudaBackend::alloc_bytes(size_t bytes) {
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  I.enter();
  const size_t n = std::max<size_t>(bytes, 1);
  void* p = nullptr;
  if (cudaError_t e = cudaMalloc(&p, n); e != cudaSuccess) {
    cudaGetLastError();
    KILN_CHECK(false, "cuda: out of device memory allocating {} MiB (holding {} MiB of "
               "activations/KV and {} MiB of weights): {}",
               n >> 20, I.device_bytes >> 20, I.arena->stats().arena_bytes >> 20,
               cudaGetErrorString(e));
  }
  // On the compute stream, ahead of the recorded ops (none of which can name this buffer).
  check_cuda(cudaMemsetAsync(p, 0, n, I.s()), "zero new buffer");
  I.allocs[Impl::u64(p)] = n;
  I.device_bytes += n;
  Impl* impl = impl_.get();
  return BackendBytes(static_cast<std::byte*>(p), [impl](std::byte* q) { impl->free_dev(q); });
}

void CudaBackend::upload_bytes(std::span<const std::byte> host, std::span<std::byte> dst) {
  KILN_CHECK(dst.size() >= host.size());
  if (host.empty()) return;
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  I.enter();
  if (!I.is_dev(dst.data())) {  // host memory: a plain copy, in order with what ran before
    I.flush();
    std::memcpy(dst.data(), host.data(), host.size());
    return;
  }
  if (host.size() > (size_t(64) << 20)) {  // too big to stage: a synchronous copy
    I.flush();
    check_cuda(cudaMemcpy(dst.data(), host.data(), host.size(), cudaMemcpyHostToDevice), "upload");
    return;
  }
  I.room(host.size() + 16);
  const std::byte* src = I.stage(host.data(), host.size(), host.size());
  std::byte* d = dst.data();
  const size_t n = host.size();
  I.sig("upload", src, d, n);
  I.record("upload", [=](cudaStream_t st) {
    return cudaMemcpyAsync(d, src, n, cudaMemcpyDeviceToDevice, st);
  });
}

void CudaBackend::download_bytes(std::span<const std::byte> src, std::span<std::byte> host) {
  KILN_CHECK(host.size() >= src.size());
  if (src.empty()) return;
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  I.enter();
  if (!I.is_dev(src.data())) {
    I.flush();
    std::memcpy(host.data(), src.data(), src.size());
    return;
  }
  const std::byte* d = src.data();
  const size_t n = src.size();
  // Page-locked destination (register_host_memory: a session's logits): one DMA straight into
  // it, no pinned bounce buffer and host copy (8 MB of logits per step at 64 sequences).
  const bool direct = I.opts.direct_download && I.pinned->holds(host.data(), n);
  if (!direct) I.reserve_out(n);
  std::byte* out = direct ? host.data() : I.pin_out->data();
  I.sig("download", d, n, out);
  I.record("download", [=](cudaStream_t st) {
    return cudaMemcpyAsync(out, d, n, cudaMemcpyDeviceToHost, st);
  });
  I.flush();
  if (!direct) std::memcpy(host.data(), out, n);
}

void CudaBackend::copy_bytes(std::span<const std::byte> src, std::span<std::byte> dst) {
  KILN_CHECK(dst.size() >= src.size());
  if (src.empty()) return;
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  I.enter();
  const bool ds = I.is_dev(src.data()), dd = I.is_dev(dst.data());
  if (!ds && !dd) {
    I.flush();
    std::memcpy(dst.data(), src.data(), src.size());
    return;
  }
  KILN_CHECK(ds && dd, "cuda copy between device and host memory: use upload/download");
  const std::byte* a = src.data();
  std::byte* b = dst.data();
  const size_t n = src.size();
  I.sig("copy", a, b, n);
  I.record("copy", [=](cudaStream_t st) {
    return cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, st);
  });
}

void CudaBackend::zero_bytes(std::span<std::byte> dst) {
  if (dst.empty()) return;
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  I.enter();
  if (!I.is_dev(dst.data())) {
    I.flush();
    std::memset(dst.data(), 0, dst.size());
    return;
  }
  std::byte* b = dst.data();
  const size_t n = dst.size();
  I.sig("zero", b, n);
  I.record("zero", [=](cudaStream_t st) { return cudaMemsetAsync(b, 0, n, st); });
}

void CudaBackend::synchronize() {
  std::lock_guard lock(impl_->mu);
  impl_->flush();
}

double CudaBackend::read_bandwidth_gbps() {
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  I.enter();
  I.flush();
  constexpr size_t kBytes = size_t(1) << 30;
  cuda::DeviceBuffer buf, sink;
  buf.ensure(kBytes, "bandwidth probe");
  const int blocks = I.n_sm * 8;
  sink.ensure(size_t(blocks) * sizeof(float), "bandwidth probe");
  check_cuda(cudaMemsetAsync(buf.get(), 0, kBytes, I.s()), "bandwidth probe");
  cuda::Event a, b;
  check_cuda(a.create(true), "event");
  check_cuda(b.create(true), "event");
  float best = 0;
  for (int i = 0; i < 6; ++i) {
    check_cuda(cudaEventRecord(a.get(), I.s()), "event record");
    check_cuda(cuda::launch_read_probe(buf.get(), kBytes, static_cast<float*>(sink.get()), blocks,
                                       I.s()),
               "bandwidth probe");
    check_cuda(cudaEventRecord(b.get(), I.s()), "event record");
    check_cuda(cudaEventSynchronize(b.get()), "bandwidth probe");
    float ms = 0;
    check_cuda(cudaEventElapsedTime(&ms, a.get(), b.get()), "event time");
    if (i > 0 && ms > 0) best = std::max(best, float(kBytes / (ms * 1e-3) / 1e9));
  }
  return best;
}

void CudaBackend::matmul(const WeightMatrix& w, std::span<const float> x, int64_t n_tok,
                         std::span<float> y) {
  KILN_CHECK(static_cast<int64_t>(x.size()) == n_tok * w.n_cols, "x {} != {}x{}", x.size(), n_tok,
             w.n_cols);
  KILN_CHECK(static_cast<int64_t>(y.size()) == n_tok * w.n_rows, "y {} != {}x{}", y.size(), n_tok,
             w.n_rows);
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  ExpertCopyFence fence{I};
  if (I.is_dev(y.data())) {
    I.enter();
    // Everything that may flush (weight refresh, workspace growth) before staging anything.
    const cuda::DeviceWeight dw = I.weight_resident(w);
    float* dy = y.data();
    cuda::GemmWorkspace* gemm = nullptr;
    const cuda::MatmulKernels kern = I.kernels();
    cuda::DeviceWeight cached = dw;  // what the cuBLAS path reads: dw or its f16 copy
    const bool wants_gemm = I.wants_gemm(kern, dw, n_tok);
    if (wants_gemm) {
      // Ops recorded against the old workspace run before it grows, and graphs that name
      // the old scratch go with it (as internal() does for the other scratch buffers).
      if (!I.gemm.fits(dw, n_tok)) {
        I.flush();
        I.destroy_graphs();
      }
      if (I.gemm.reserve(dw, n_tok)) gemm = &I.gemm;
      if (gemm) cached = I.f16_cached(w, dw);
    }
    size_t act_bytes = 0;
    std::byte* act = kern == cuda::MatmulKernels::V3 ? I.v3_act(dw, n_tok, &act_bytes) : nullptr;
    I.room(I.float_room(x));
    const float* dx = I.floats(x);
    I.sig("matmul", dw.data, dw.dtype, dw.n_cols, dw.n_rows, dw.row_bytes, dx, n_tok, dy, kern,
          act, cached.data, gemm ? gemm->scratch() : nullptr);
    const bool from_cache = cached.data != dw.data;
    if (I.profile) {
      const char* path = from_cache ? "gemm, f16 cache"
                         : gemm     ? "gemm"
                         : act      ? "int8"
                         : wants_gemm ? "gemm" : "matvec";
      I.next_label = fmt::format("matmul {} {}x{} x{} {}", dtype_name(w.dtype), w.n_cols,
                                 w.n_rows, n_tok, path);
      I.next_bytes = static_cast<uint64_t>(dw.row_bytes) * static_cast<uint64_t>(dw.n_rows);
    }
    // Without gemm_graphs cuBLAS works in its own pool's workspace, which a graph must not
    // name: segments that use it are never graphs. With it, cuBLAS has a fixed workspace that
    // lives as long as the backend, and the f16 scratch (in the signature above) only moves
    // through the destroy_graphs() above. Set here, after everything above that may flush (a
    // flush starts a graphable segment).
    if (wants_gemm && !(I.gemm_graphs() && gemm && gemm->cublas_workspace())) I.graphable = false;
    const int mma_min = I.mma_min_tokens();
    I.record("matmul", [=](cudaStream_t st) {
      // The f16 copy is what the GEMM would have dequantized into its scratch: cuBLAS reads
      // it in place (gemm.cu) with the same call.
      if (from_cache)
        return cuda::launch_matmul(cached, dx, n_tok, dy, st, gemm);
      if (kern == cuda::MatmulKernels::V3)
        return cuda::launch_matmul_v3(dw, dx, n_tok, dy, act, act_bytes, st, gemm, mma_min);
      return cuda::launch_matmul(dw, dx, n_tok, dy, st, gemm);
    });
    return;
  }
  I.begin_host_op({x.data()}, "matmul");
  const cuda::DeviceWeight dw = I.weight(w);
  const float* dx = I.upload<float>(0, x);
  float* dy = I.buffer<float>(1, y.size());
  cuda::GemmWorkspace* gemm = nullptr;
  if (I.wants_gemm(I.kernels(), dw, n_tok) && I.gemm.reserve(dw, n_tok)) gemm = &I.gemm;
  const size_t act_bytes = I.kernels() == cuda::MatmulKernels::V3 &&
                                   cuda::matvec_q8_supports(dw.dtype) &&
                                   n_tok <= I.int8_max_tokens()
                               ? cuda::act_q8_bytes(dw.n_cols, n_tok)
                               : 0;
  std::byte* act = act_bytes ? I.buffer<std::byte>(2, act_bytes) : nullptr;
  I.launch("matmul", [&] {
    if (I.kernels() == cuda::MatmulKernels::V3)
      return cuda::launch_matmul_v3(dw, dx, n_tok, dy, act, act_bytes, I.s(), gemm,
                                    I.mma_min_tokens());
    return cuda::launch_matmul(dw, dx, n_tok, dy, I.s(), gemm);
  });
  I.download(y, static_cast<const float*>(dy));
  I.finish("matmul");
}

// SwiGLU inside the down projection's int8 activation quantization, where matmul() would take
// V3's int8 path for w at n_tok (the same conditions, the same scratch, launch_matvec_q8 after
// the quantization as launch_matmul_v3 runs it): the quantized blocks are those of the
// separate swiglu() op's output (the same expression, act.cuh), so y has the unfused bits.
// Anything else: swiglu() then matmul().
void CudaBackend::swiglu_matmul(const WeightMatrix& w, std::span<const float> gate,
                                std::span<const float> up, int64_t n_tok, std::span<float> act,
                                std::span<float> y) {
  KILN_CHECK(static_cast<int64_t>(gate.size()) == n_tok * w.n_cols &&
                 up.size() == gate.size() && act.size() == gate.size(),
             "swiglu_matmul: gate {} up {} act {} for {}x{}", gate.size(), up.size(), act.size(),
             n_tok, w.n_cols);
  KILN_CHECK(static_cast<int64_t>(y.size()) == n_tok * w.n_rows, "y {} != {}x{}", y.size(), n_tok,
             w.n_rows);
  Impl& I = *impl_;
  std::unique_lock lock(I.mu);
  const bool fused = I.opts.fuse_swiglu && I.kernels() == cuda::MatmulKernels::V3 &&
                     cuda::matvec_q8_supports(w.dtype) && n_tok >= 1 &&
                     n_tok <= I.int8_max_tokens() && cuda::act_q8_bytes(w.n_cols, n_tok) > 0 &&
                     I.is_dev(gate.data()) && I.is_dev(up.data()) && I.is_dev(y.data());
  if (!fused) {
    lock.unlock();
    Backend::swiglu_matmul(w, gate, up, n_tok, act, y);
    return;
  }
  ExpertCopyFence fence{I};
  I.enter();
  const cuda::DeviceWeight dw = I.weight_resident(w);
  size_t act_bytes = 0;
  std::byte* qa = I.v3_act(dw, n_tok, &act_bytes);
  KILN_CHECK(qa != nullptr && act_bytes > 0, "swiglu_matmul: int8 scratch");
  const float* dg = gate.data();
  const float* du = up.data();
  float* dy = y.data();
  const int mma_min = I.mma_min_tokens();
  I.sig("swiglu_matmul", dw.data, dw.dtype, dw.n_cols, dw.n_rows, dw.row_bytes, dg, du, n_tok, dy,
        qa);
  if (I.profile) {
    I.next_label = fmt::format("matmul {} {}x{} x{} int8, swiglu fused", dtype_name(w.dtype),
                               w.n_cols, w.n_rows, n_tok);
    I.next_bytes = static_cast<uint64_t>(dw.row_bytes) * static_cast<uint64_t>(dw.n_rows);
  }
  I.record("swiglu_matmul", [=](cudaStream_t st) {
    if (cudaError_t e = cuda::launch_quantize_act_q8(dg, dw.n_cols, n_tok, qa, st, du);
        e != cudaSuccess)
      return e;
    return cuda::launch_matvec_q8(dw, qa, n_tok, dy, st, mma_min);
  });
}

// Consecutive tasks of one weight layout (type, row size, alignment) run as one grouped launch
// (launch_matvec_*_group: each output has its own launch's bits); a group the launcher refuses
// goes task by task. `one(i)` launches task i alone, `group(first, n)` a group.
template <typename One, typename Group>
cudaError_t run_grouped(std::span<const cuda::DeviceWeight> ws, One&& one, Group&& group) {
  for (size_t i = 0; i < ws.size();) {
    size_t n = 1;
    while (i + n < ws.size() && n < size_t(cuda::kMatvecGroupMax) &&
           ws[i + n].dtype == ws[i].dtype && ws[i + n].row_bytes == ws[i].row_bytes &&
           (reinterpret_cast<uintptr_t>(ws[i + n].data) % 16 == 0) ==
               (reinterpret_cast<uintptr_t>(ws[i].data) % 16 == 0))
      ++n;
    cudaError_t e = n > 1 ? group(i, n) : cudaErrorNotSupported;
    if (e == cudaErrorNotSupported)
      for (size_t j = i; j < i + n && (e == cudaErrorNotSupported || e == cudaSuccess); ++j)
        e = one(j);
    if (e != cudaSuccess) return e;
    i += n;
  }
  return cudaSuccess;
}

// Tasks that share one resident input (a layer's Q/K/V, gate/up) on V3's int8 path: the input
// is quantized once and every weight reads that (launch_matvec_q8 is what matmul() runs after
// its own quantization of the same x, so each y has matmul()'s bits), same-layout runs of them
// in one grouped launch; float weights take matmul_batch_float below. Anything else: one
// matmul() per task.
void CudaBackend::matmul_batch(std::span<const MatmulTask> tasks, int64_t n_tok) {
  Impl& I = *impl_;
  std::unique_lock lock(I.mu);
  if (matmul_batch_float(tasks, n_tok)) return;
  bool shared = tasks.size() > 1 && I.kernels() == cuda::MatmulKernels::V3 &&
                n_tok <= I.int8_max_tokens() && I.is_dev(tasks[0].x.data());
  for (const MatmulTask& t : tasks) {
    if (!shared) break;
    KILN_CHECK(static_cast<int64_t>(t.x.size()) == n_tok * t.w->n_cols &&
                   static_cast<int64_t>(t.y.size()) == n_tok * t.w->n_rows,
               "matmul_batch task shape");
    shared = t.x.data() == tasks[0].x.data() && t.w->n_cols == tasks[0].w->n_cols &&
             cuda::matvec_q8_supports(t.w->dtype) && I.is_dev(t.y.data());
  }
  if (!shared || cuda::act_q8_bytes(tasks[0].w->n_cols, n_tok) == 0) {
    lock.unlock();
    Backend::matmul_batch(tasks, n_tok);
    return;
  }
  ExpertCopyFence fence{I};
  I.enter();
  struct One {
    cuda::DeviceWeight w;
    float* y;
  };
  std::vector<One> ones;
  ones.reserve(tasks.size());
  for (const MatmulTask& t : tasks) ones.push_back({I.weight_resident(*t.w), t.y.data()});
  size_t act_bytes = 0;
  std::byte* act = I.v3_act(ones[0].w, n_tok, &act_bytes);  // may flush: before staging
  const float* dx = tasks[0].x.data();
  const int64_t n_cols = tasks[0].w->n_cols;
  I.sig("matmul_batch", dx, n_tok, act, ones.size());
  uint64_t bytes = 0;
  for (const One& o : ones) {
    I.sig("matmul_batch", o.w.data, o.w.dtype, o.w.n_cols, o.w.n_rows, o.w.row_bytes, o.y);
    bytes += static_cast<uint64_t>(o.w.row_bytes) * static_cast<uint64_t>(o.w.n_rows);
  }
  if (I.profile) {
    std::string types;
    int64_t rows = 0;
    for (const One& o : ones) {
      types += fmt::format("{}{}", types.empty() ? "" : "+", dtype_name(o.w.dtype));
      rows += o.w.n_rows;
    }
    I.next_label = fmt::format("matmul {} {}x{} x{} int8 ({} weights, one quantization)", types,
                               n_cols, rows, n_tok, ones.size());
    I.next_bytes = bytes;
  }
  std::vector<cuda::DeviceWeight> dws;
  std::vector<float*> dys;
  for (const One& o : ones) dws.push_back(o.w), dys.push_back(o.y);
  const int mma_min = I.mma_min_tokens();
  I.record("matmul_batch", [=](cudaStream_t st) {
    if (cudaError_t e = cuda::launch_quantize_act_q8(dx, n_cols, n_tok, act, st); e != cudaSuccess)
      return e;
    return run_grouped(
        dws,
        [&](size_t i) { return cuda::launch_matvec_q8(dws[i], act, n_tok, dys[i], st, mma_min); },
        [&](size_t i, size_t n) {
          return cuda::launch_matvec_q8_group(std::span(dws).subspan(i, n),
                                              std::span(dys).subspan(i, n), act, n_tok, st,
                                              mma_min);
        });
  });
}

// Float weights sharing one resident input, up to kAutoFloatMaxTokens tokens on V3's float
// kernel (what matmul() runs for each of them there): one grouped launch per run of the same
// layout, with the rows per warp float_v3_rows gives the first (every choice has the same bits,
// CudaMatvecQ8.FloatRowsAndColumnsKeepBits). False (nothing recorded) when that is not the
// path each task would take alone.
bool CudaBackend::matmul_batch_float(std::span<const MatmulTask> tasks, int64_t n_tok) {
  Impl& I = *impl_;
  if (tasks.size() < 2 || I.kernels() != cuda::MatmulKernels::V3 || n_tok < 1 ||
      n_tok > Impl::kAutoFloatMaxTokens || !I.is_dev(tasks[0].x.data()))
    return false;
  for (const MatmulTask& t : tasks) {
    KILN_CHECK(static_cast<int64_t>(t.x.size()) == n_tok * t.w->n_cols &&
                   static_cast<int64_t>(t.y.size()) == n_tok * t.w->n_rows,
               "matmul_batch task shape");
    const DType d = t.w->dtype;
    if (t.x.data() != tasks[0].x.data() || t.w->n_cols != tasks[0].w->n_cols ||
        !(d == DType::F16 || d == DType::BF16 || d == DType::F32) || !I.is_dev(t.y.data()) ||
        t.w->content_key != 0)
      return false;
  }
  ExpertCopyFence fence{I};
  I.enter();
  std::vector<cuda::DeviceWeight> dws;
  std::vector<float*> dys;
  for (const MatmulTask& t : tasks) {
    dws.push_back(I.weight_resident(*t.w));
    dys.push_back(t.y.data());
  }
  const float* dx = tasks[0].x.data();
  // matmul()'s own route for each: the float kernel, not cuBLAS nor the V2 fallback.
  for (const cuda::DeviceWeight& w : dws)
    if (I.wants_gemm(cuda::MatmulKernels::V3, w, n_tok) ||
        !cuda::float_v3_applies(w, dx, n_tok))
      return false;
  I.sig("matmul_batch_float", dx, n_tok, dws.size());
  uint64_t bytes = 0;
  for (size_t i = 0; i < dws.size(); ++i) {
    const cuda::DeviceWeight& w = dws[i];
    I.sig("matmul_batch_float", w.data, w.dtype, w.n_cols, w.n_rows, w.row_bytes, dys[i]);
    bytes += static_cast<uint64_t>(w.row_bytes) * static_cast<uint64_t>(w.n_rows);
  }
  if (I.profile) {
    int64_t rows = 0;
    for (const cuda::DeviceWeight& w : dws) rows += w.n_rows;
    I.next_label = fmt::format("matmul {} {}x{} x{} matvec ({} weights, grouped launches)",
                               dtype_name(dws[0].dtype), dws[0].n_cols, rows, n_tok, dws.size());
    I.next_bytes = bytes;
  }
  I.record("matmul_batch_float", [=](cudaStream_t st) {
    return run_grouped(
        dws,
        [&](size_t i) {
          return cuda::launch_matvec_float_v3(
              dws[i], dx, n_tok, dys[i],
              cuda::float_v3_rows(dws[i].dtype, n_tok, dws[i].n_rows, dws[i].n_cols), st);
        },
        [&](size_t i, size_t n) {
          const cuda::DeviceWeight& w = dws[i];
          return cuda::launch_matvec_float_v3_group(
              std::span(dws).subspan(i, n), std::span(dys).subspan(i, n), dx, n_tok,
              cuda::float_v3_rows(w.dtype, n_tok, w.n_rows, w.n_cols), st);
        });
  });
  return true;
}

void CudaBackend::get_rows(const WeightMatrix& w, std::span<const int32_t> ids,
                           std::span<float> out) {
  KILN_CHECK(out.size() == ids.size() * static_cast<size_t>(w.n_cols));
  for (int32_t id : ids) KILN_CHECK(id >= 0 && id < w.n_rows, "row id {} of {}", id, w.n_rows);
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  ExpertCopyFence fence{I};
  if (I.is_dev(out.data())) {
    I.enter();
    const cuda::DeviceWeight dw = I.weight_resident(w);  // may flush: before staging
    I.room(I.host_bytes(ids));
    const int32_t* dids = I.ints(ids);
    float* dout = out.data();
    const auto n = static_cast<int64_t>(ids.size());
    I.sig("get_rows", dw.data, dw.dtype, dw.n_cols, dw.n_rows, dids, n, dout);
    I.record("get_rows",
             [=](cudaStream_t st) { return cuda::launch_get_rows(dw, dids, n, dout, st); });
    return;
  }
  I.begin_host_op({}, "get_rows");
  const cuda::DeviceWeight dw = I.weight(w);
  const int32_t* dids = I.upload<int32_t>(0, ids);
  float* dout = I.buffer<float>(1, out.size());
  I.launch("get_rows", [&] {
    return cuda::launch_get_rows(dw, dids, static_cast<int64_t>(ids.size()), dout, I.s());
  });
  I.download(out, static_cast<const float*>(dout));
  I.finish("get_rows");
}

void CudaBackend::rmsnorm(std::span<const float> x, std::span<const float> weight, int64_t n,
                          float eps, std::span<float> y) {
  KILN_CHECK(n > 0 && x.size() % n == 0 && y.size() == x.size());
  KILN_CHECK(weight.empty() || static_cast<int64_t>(weight.size()) == n);
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  if (I.is_dev(y.data())) {
    I.record_norm(x, nullptr, weight, n, eps, y.data());
    return;
  }
  I.begin_host_op({x.data(), weight.data()}, "rmsnorm");
  const float* dx = I.upload<float>(0, x);
  const float* dw = weight.empty() ? nullptr : I.upload<float>(1, weight);
  float* dy = I.buffer<float>(2, y.size());
  I.launch("rmsnorm", [&] {
    return cuda::launch_rmsnorm(dx, dw, static_cast<int64_t>(x.size()) / n, n, eps, dy, I.s());
  });
  I.download(y, static_cast<const float*>(dy));
  I.finish("rmsnorm");
}

void CudaBackend::add_rmsnorm(std::span<float> x, std::span<const float> a,
                              std::span<const float> weight, int64_t n, float eps,
                              std::span<float> y) {
  KILN_CHECK(n > 0 && x.size() % n == 0 && y.size() == x.size() && a.size() == x.size());
  KILN_CHECK(weight.empty() || static_cast<int64_t>(weight.size()) == n);
  Impl& I = *impl_;
  {
    std::lock_guard lock(I.mu);
    if (I.is_dev(x.data()) && I.is_dev(y.data())) {
      I.record_norm(a, x.data(), weight, n, eps, y.data());
      return;
    }
  }
  // Host spans: the two ops, each with its own transfers (the same bits).
  Backend::add_rmsnorm(x, a, weight, n, eps, y);
}

void CudaBackend::rope(std::span<float> x, int64_t n_tok, int64_t n_head, int64_t head_dim,
                       std::span<const int32_t> pos, const RopeParams& p) {
  KILN_CHECK(static_cast<int64_t>(x.size()) == n_tok * n_head * head_dim);
  KILN_CHECK(static_cast<int64_t>(pos.size()) == n_tok);
  KILN_CHECK(p.n_rot > 0 && p.n_rot % 2 == 0 && p.n_rot <= head_dim, "n_rot {}", p.n_rot);
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  if (I.is_dev(x.data())) {
    I.record_rope(x.data(), n_head, nullptr, 0, n_tok, head_dim, pos, p);
    return;
  }
  I.begin_host_op({}, "rope");
  float* dx = I.upload<float>(0, std::span<const float>(x));
  const int32_t* dpos = I.upload<int32_t>(1, pos);
  I.launch("rope", [&] {
    return cuda::launch_rope(dx, n_tok, n_head, head_dim, dpos, p.n_rot, p.freq_base, p.freq_scale,
                             p.style == RopeStyle::NeoX, I.s());
  });
  I.download(x, static_cast<const float*>(dx));
  I.finish("rope");
}

void CudaBackend::rope_qk(std::span<float> q, int64_t n_head_q, std::span<float> k,
                          int64_t n_head_k, int64_t n_tok, int64_t head_dim,
                          std::span<const int32_t> pos, const RopeParams& p) {
  Impl& I = *impl_;
  std::unique_lock lock(I.mu);
  if (!(I.opts.fuse_rope && I.is_dev(q.data()) && I.is_dev(k.data()))) {
    lock.unlock();
    Backend::rope_qk(q, n_head_q, k, n_head_k, n_tok, head_dim, pos, p);  // two rope() ops
    return;
  }
  KILN_CHECK(static_cast<int64_t>(q.size()) == n_tok * n_head_q * head_dim);
  KILN_CHECK(static_cast<int64_t>(k.size()) == n_tok * n_head_k * head_dim);
  KILN_CHECK(static_cast<int64_t>(pos.size()) == n_tok);
  KILN_CHECK(p.n_rot > 0 && p.n_rot % 2 == 0 && p.n_rot <= head_dim, "n_rot {}", p.n_rot);
  I.record_rope(q.data(), n_head_q, k.data(), n_head_k, n_tok, head_dim, pos, p);
}

void CudaBackend::softmax(std::span<float> x, int64_t n) {
  KILN_CHECK(n > 0 && x.size() % n == 0);
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  if (I.is_dev(x.data())) {
    float* dx = x.data();
    const int64_t rows = static_cast<int64_t>(x.size()) / n;
    I.sig("softmax", dx, rows, n);
    I.record("softmax", [=](cudaStream_t st) { return cuda::launch_softmax(dx, rows, n, st); });
    return;
  }
  I.begin_host_op({}, "softmax");
  float* dx = I.upload<float>(0, std::span<const float>(x));
  I.launch("softmax",
           [&] { return cuda::launch_softmax(dx, static_cast<int64_t>(x.size()) / n, n, I.s()); });
  I.download(x, static_cast<const float*>(dx));
  I.finish("softmax");
}

void CudaBackend::swiglu(std::span<const float> gate, std::span<const float> up,
                         std::span<float> out) {
  impl_->binary(gate, up, out, cuda::Binary::SwiGLU, "swiglu");
}
void CudaBackend::geglu(std::span<const float> gate, std::span<const float> up,
                        std::span<float> out) {
  impl_->binary(gate, up, out, cuda::Binary::GeGLU, "geglu");
}
void CudaBackend::add(std::span<const float> a, std::span<const float> b, std::span<float> out) {
  impl_->binary(a, b, out, cuda::Binary::Add, "add");
}
void CudaBackend::mul(std::span<const float> a, std::span<const float> b, std::span<float> out) {
  impl_->binary(a, b, out, cuda::Binary::Mul, "mul");
}
void CudaBackend::scale(std::span<float> x, float s) {
  impl_->unary(x, cuda::Unary::Scale, s, "scale");
}
void CudaBackend::softcap(std::span<float> x, float cap) {
  KILN_CHECK(cap > 0);
  impl_->unary(x, cuda::Unary::Softcap, cap, "softcap");
}
void CudaBackend::sigmoid(std::span<float> x) {
  impl_->unary(x, cuda::Unary::Sigmoid, 0, "sigmoid");
}

namespace {
void check_attention_args(const AttentionArgs& a) {
  KILN_CHECK(a.n_head > 0 && a.n_head_kv > 0 && a.n_head % a.n_head_kv == 0);
  KILN_CHECK(a.head_dim > 0 && a.head_dim <= 256, "cuda attention: head_dim {} (at most 256)",
             a.head_dim);
  const int64_t hd = a.head_dim, q_w = a.n_head * hd, kv_w = a.n_head_kv * hd;
  const int64_t n_kv = static_cast<int64_t>(a.kv_rows.size());
  KILN_CHECK(static_cast<int64_t>(a.q.size()) == a.n_q * q_w);
  KILN_CHECK(a.out.size() == a.q.size());
  KILN_CHECK(static_cast<int64_t>(a.q_pos.size()) == a.n_q);
  KILN_CHECK(static_cast<int64_t>(a.kv_pos.size()) == n_kv);
  KILN_CHECK(a.k.size() == a.v.size() && a.k.size() % kv_w == 0);
  const int64_t n_phys = static_cast<int64_t>(a.k.size()) / kv_w;
  for (int32_t r : a.kv_rows) KILN_CHECK(r >= 0 && r < n_phys, "kv row {} of {}", r, n_phys);
}

// The kernel's view of a: its shapes and scalars for n_kv keys (the pointers are set by the
// caller, which knows where each array lives).
// warp_tiles: CudaOptions::attention_warp_tiles, taken where the kernel can serve the planes.
cuda::DeviceAttention attention_shape(const AttentionArgs& a, int64_t n_kv, bool warp_tiles) {
  cuda::DeviceAttention d;
  d.warp_tiles =
      warp_tiles && cuda::attention_warp_tiles_fit(a.head_dim, a.k.data(), a.v.data());
  d.n_q = a.n_q;
  d.n_kv = n_kv;
  d.n_head = a.n_head;
  d.n_head_kv = a.n_head_kv;
  d.head_dim = a.head_dim;
  d.window = a.window;
  d.scale = a.scale;
  d.softcap = a.softcap;
  d.out = a.out.data();
  return d;
}

void check_store_rows(std::span<const float> src, int64_t width, std::span<const int32_t> rows,
                      std::span<const f16> plane) {
  KILN_CHECK(width > 0 && src.size() == rows.size() * static_cast<size_t>(width));
  KILN_CHECK(plane.size() % width == 0);
  const int64_t n_phys = static_cast<int64_t>(plane.size()) / width;
  for (int32_t r : rows) KILN_CHECK(r >= 0 && r < n_phys, "row {} of {}", r, n_phys);
}
}  // namespace

void CudaBackend::store_rows_f16(std::span<const float> src, int64_t width,
                                 std::span<const int32_t> rows, std::span<f16> plane) {
  check_store_rows(src, width, rows, plane);
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  if (I.is_dev(plane.data())) {
    I.enter();
    I.room(I.float_room(src) + I.host_bytes(rows));
    const float* dsrc = I.floats(src);
    const int32_t* drows = I.ints(rows);
    auto* dplane = reinterpret_cast<uint16_t*>(plane.data());
    const auto nr = static_cast<int64_t>(rows.size());
    I.sig("store_rows_f16", dsrc, width, drows, nr, dplane);
    I.record("store_rows_f16", [=](cudaStream_t st) {
      return cuda::launch_store_rows_f16(dsrc, width, drows, nr, dplane, st);
    });
    return;
  }
  I.begin_host_op({src.data()}, "store_rows_f16");
  // The plane lives on the host here: convert into dense rows on the device, then scatter on
  // the host; a device-resident plane passes its own rows to the same kernel.
  std::vector<int32_t> dense(rows.size());
  std::iota(dense.begin(), dense.end(), 0);
  const float* dsrc = I.upload<float>(0, src);
  const int32_t* drows = I.upload<int32_t>(1, std::span<const int32_t>(dense));
  uint16_t* dout = I.buffer<uint16_t>(2, src.size());
  I.launch("store_rows_f16", [&] {
    return cuda::launch_store_rows_f16(dsrc, width, drows, static_cast<int64_t>(rows.size()), dout,
                                       I.s());
  });
  std::vector<f16> host(src.size());
  check_cuda(
      cudaMemcpyAsync(host.data(), dout, host.size() * sizeof(f16), cudaMemcpyDeviceToHost, I.s()),
      "copy to host");
  I.finish("store_rows_f16");
  for (size_t i = 0; i < rows.size(); ++i)
    std::copy_n(host.begin() + static_cast<ptrdiff_t>(i * width), width,
                plane.begin() + static_cast<ptrdiff_t>(rows[i] * width));
}


// The sequences that take the split kernel run as one launch pair (plan_attention_batch gives
// each the plan it would get alone, so each out has attention()'s bits); prefill-sized ones
// (the tile kernel) and host-span calls run one attention() each.
void CudaBackend::attention_batch(std::span<const AttentionArgs> seqs) {
  Impl& I = *impl_;
  std::vector<const AttentionArgs*> batched;
  {
    std::lock_guard lock(I.mu);
    for (const AttentionArgs& a : seqs) {
      check_attention_args(a);
      const cuda::DeviceAttention shape =
          attention_shape(a, static_cast<int64_t>(a.kv_rows.size()), I.opts.attention_warp_tiles);
      const AttentionArgs& a0 = seqs.front();
      // One kernel serves the launch: every item must take the first one's (warp tiles or not).
      const bool same_kernel =
          shape.warp_tiles == attention_shape(a0, 0, I.opts.attention_warp_tiles).warp_tiles;
      if (same_kernel && I.is_dev(a.out.data()) && I.is_dev(a.k.data()) &&
          I.is_dev(a.v.data()) && a.n_q > 0 &&
          !a.kv_rows.empty() && a.head_dim % 2 == 0 && a.n_head == a0.n_head &&
          a.n_head_kv == a0.n_head_kv && a.head_dim == a0.head_dim &&
          !cuda::attention_uses_tiles(shape))
        batched.push_back(&a);
    }
  }
  if (batched.size() < 2) batched.clear();
  for (const AttentionArgs& a : seqs)
    if (std::find(batched.begin(), batched.end(), &a) == batched.end()) attention(a);
  if (batched.empty()) return;

  std::lock_guard lock(I.mu);
  I.enter();
  std::vector<cuda::AttentionBatchItem> items(batched.size());
  std::vector<size_t> pads(batched.size(), 0);
  size_t part_floats = 0, room = 0;
  for (size_t i = 0; i < batched.size(); ++i) {
    const AttentionArgs& a = *batched[i];
    const auto n_kv = static_cast<int64_t>(a.kv_rows.size());
    pads[i] = I.kv_pad(n_kv);  // exactly as attention() pads it alone
    cuda::DeviceAttention& d = items[i].a;
    d = attention_shape(a, std::max<int64_t>(n_kv, static_cast<int64_t>(pads[i])),
                        I.opts.attention_warp_tiles);
    part_floats += cuda::attention_scratch_floats(d, I.n_sm);
    room += I.float_room(a.q) + I.host_bytes(a.kv_rows, pads[i]) +
            I.host_bytes(a.kv_pos, pads[i]) + I.host_bytes(a.q_pos);
  }
  // Scratch first (growing it flushes), then every staged array and the table.
  float* part = I.internal<float>(I.attn_part, part_floats, I.attn_cap);
  I.room(room + items.size() * sizeof(cuda::AttentionBatchItem) + 16);
  size_t off = 0;
  for (size_t i = 0; i < batched.size(); ++i) {
    const AttentionArgs& a = *batched[i];
    cuda::DeviceAttention& d = items[i].a;
    d.q = I.floats(a.q);
    d.k = reinterpret_cast<const uint16_t*>(a.k.data());
    d.v = reinterpret_cast<const uint16_t*>(a.v.data());
    d.kv_rows = I.ints(a.kv_rows, pads[i], 0);
    d.kv_pos = I.ints(a.kv_pos, pads[i], INT32_MAX);
    d.q_pos = I.ints(a.q_pos);
    items[i].part = part + off;
    off += cuda::attention_scratch_floats(d, I.n_sm);
  }
  cuda::plan_attention_batch(items, I.n_sm);
  const auto* table = reinterpret_cast<const cuda::AttentionBatchItem*>(
      I.stage(items.data(), items.size() * sizeof(cuda::AttentionBatchItem),
              items.size() * sizeof(cuda::AttentionBatchItem)));
  I.sig("attention_batch", table, items.size(), part);
  for (const cuda::AttentionBatchItem& it : items) {
    const cuda::DeviceAttention& d = it.a;
    I.sig("attention_batch", d.q, d.k, d.v, d.kv_rows, d.kv_pos, d.q_pos, d.n_q, d.n_kv,
          d.n_head, d.n_head_kv, d.head_dim, d.window, d.scale, d.softcap, d.out, d.warp_tiles);
  }
  if (I.profile) I.next_label = fmt::format("attention x{} sequences (one launch)", items.size());
  I.record("attention_batch", [=](cudaStream_t st) {
    return cuda::launch_attention_batch(table, items, st);
  });
}

void CudaBackend::store_rows_f16_batch(std::span<const StoreRowsTask> tasks) {
  Impl& I = *impl_;
  bool resident = tasks.size() > 1 && tasks.size() <= 65535;
  {
    std::lock_guard lock(I.mu);
    for (const StoreRowsTask& t : tasks) {
      check_store_rows(t.src, t.width, t.rows, t.plane);
      resident = resident && I.is_dev(t.plane.data());
    }
  }
  if (!resident) {
    Backend::store_rows_f16_batch(tasks);
    return;
  }
  std::lock_guard lock(I.mu);
  I.enter();
  size_t room = tasks.size() * sizeof(cuda::StoreRowsItem) + 16;
  for (const StoreRowsTask& t : tasks) room += I.float_room(t.src) + I.host_bytes(t.rows);
  I.room(room);
  std::vector<cuda::StoreRowsItem> items(tasks.size());
  int64_t most = 0;
  for (size_t i = 0; i < tasks.size(); ++i) {
    const StoreRowsTask& t = tasks[i];
    items[i].src = I.floats(t.src);
    items[i].rows = I.ints(t.rows);
    items[i].n_rows = static_cast<int64_t>(t.rows.size());
    items[i].width = t.width;
    items[i].plane = reinterpret_cast<uint16_t*>(t.plane.data());
    most = std::max(most, items[i].n_rows * t.width);
  }
  const auto* table = reinterpret_cast<const cuda::StoreRowsItem*>(
      I.stage(items.data(), items.size() * sizeof(cuda::StoreRowsItem),
              items.size() * sizeof(cuda::StoreRowsItem)));
  I.sig("store_rows_f16_batch", table, items.size(), most);
  for (const cuda::StoreRowsItem& it : items)
    I.sig("store_rows_f16_batch", it.src, it.rows, it.n_rows, it.width, it.plane);
  const int n = static_cast<int>(items.size());
  if (I.profile) I.next_label = fmt::format("store_rows_f16 x{} (one launch)", n);
  I.record("store_rows_f16_batch", [=](cudaStream_t st) {
    return cuda::launch_store_rows_f16_batch(table, n, most, st);
  });
}

void CudaBackend::attention(const AttentionArgs& a) {
  check_attention_args(a);
  const int64_t n_kv = static_cast<int64_t>(a.kv_rows.size());
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  if (I.is_dev(a.out.data())) {
    KILN_CHECK(I.is_dev(a.k.data()) && I.is_dev(a.v.data()),
               "cuda attention: device output needs device KV planes");
    I.enter();
    const size_t pad_n = I.kv_pad(n_kv);
    cuda::DeviceAttention d = attention_shape(
        a, std::max<int64_t>(n_kv, static_cast<int64_t>(pad_n)), I.opts.attention_warp_tiles);
    // Scratch first: growing it flushes, which restarts staging, so nothing may be staged
    // for this op before (the staged pointers would then name reused staging space).
    float* part =
        I.internal<float>(I.attn_part, cuda::attention_scratch_floats(d, I.n_sm), I.attn_cap);
    I.room(I.float_room(a.q) + I.host_bytes(a.kv_rows, pad_n) + I.host_bytes(a.kv_pos, pad_n) +
           I.host_bytes(a.q_pos));
    d.q = I.floats(a.q);
    d.k = reinterpret_cast<const uint16_t*>(a.k.data());
    d.v = reinterpret_cast<const uint16_t*>(a.v.data());
    d.kv_rows = I.ints(a.kv_rows, pad_n, 0);
    d.kv_pos = I.ints(a.kv_pos, pad_n, INT32_MAX);
    d.q_pos = I.ints(a.q_pos);
    const int n_sm = I.n_sm;
    I.sig("attention", d.q, d.k, d.v, d.kv_rows, d.kv_pos, d.q_pos, d.n_q, d.n_kv, d.n_head,
          d.n_head_kv, d.head_dim, d.window, d.scale, d.softcap, d.out, part, d.warp_tiles);
    I.record("attention",
             [=](cudaStream_t st) { return cuda::launch_attention(d, part, n_sm, st); });
    return;
  }
  I.begin_host_op({a.q.data(), a.k.data(), a.v.data()}, "attention");
  // Host spans: whether the kernel fits is decided on the device copies, below.
  cuda::DeviceAttention d = attention_shape(a, n_kv, false);
  d.q = I.upload<float>(0, a.q);
  d.k = reinterpret_cast<const uint16_t*>(I.upload<f16>(1, a.k));
  d.v = reinterpret_cast<const uint16_t*>(I.upload<f16>(2, a.v));
  d.kv_rows = I.upload<int32_t>(3, a.kv_rows);
  d.kv_pos = I.upload<int32_t>(4, a.kv_pos);
  d.q_pos = I.upload<int32_t>(5, a.q_pos);
  d.warp_tiles = I.opts.attention_warp_tiles && cuda::attention_warp_tiles_fit(a.head_dim, d.k, d.v);
  float* dout = I.buffer<float>(6, a.out.size());
  d.out = dout;
  float* part = I.buffer<float>(7, cuda::attention_scratch_floats(d, I.n_sm));
  I.launch("attention", [&] { return cuda::launch_attention(d, part, I.n_sm, I.s()); });
  I.download(a.out, static_cast<const float*>(dout));
  I.finish("attention");
}

int64_t CudaBackend::argmax(std::span<const float> x) {
  KILN_CHECK(!x.empty());
  Impl& I = *impl_;
  std::lock_guard lock(I.mu);
  if (I.is_dev(x.data())) {
    I.enter();
    const float* dx = x.data();
    const auto n = static_cast<int64_t>(x.size());
    int64_t* dbest = I.internal<int64_t>(I.argmax_out, 1, I.argmax_cap);
    I.reserve_out(sizeof(int64_t));
    std::byte* out = I.pin_out->data();
    I.sig("argmax", dx, n, dbest, out);
    I.record("argmax", [=](cudaStream_t st) {
      if (cudaError_t e = cuda::launch_argmax(dx, n, dbest, st); e != cudaSuccess) return e;
      return cudaMemcpyAsync(out, dbest, sizeof(int64_t), cudaMemcpyDeviceToHost, st);
    });
    I.flush();
    int64_t best = 0;
    std::memcpy(&best, out, sizeof(best));
    return best;
  }
  I.begin_host_op({}, "argmax");
  const float* dx = I.upload<float>(0, x);
  int64_t* dbest = I.buffer<int64_t>(1, 1);
  I.launch("argmax",
           [&] { return cuda::launch_argmax(dx, static_cast<int64_t>(x.size()), dbest, I.s()); });
  int64_t best = 0;
  I.download(std::span<int64_t>(&best, 1), static_cast<const int64_t*>(dbest));
  I.finish("argmax");
  return best;
}

void CudaBackend::top_k(std::span<const float> x, int64_t n, int32_t k, std::span<int32_t> ids,
                        std::span<float> vals) {
  static_assert(cuda::kTopKMax == kTopKMost);
  const auto rows = static_cast<int64_t>(top_k_rows(x, n, k, ids, vals));
  Impl& I = *impl_;
  if (k > cuda::kTopKMax || rows > 65535) {  // beyond the kernel: the whole rows, sorted here
    std::vector<float> host(x.size());
    download(x, std::span<float>(host));
    Backend::top_k(host, n, k, ids, vals);
    return;
  }
  const size_t half = cuda::top_k_scratch(rows, n, k), n_out = static_cast<size_t>(rows * k);
  std::lock_guard lock(I.mu);
  if (I.is_dev(x.data())) {
    I.enter();
    // Scratch and the download buffer first: growing either flushes.
    float* sv = I.internal<float>(I.topk_v, 2 * half + n_out, I.topk_v_cap);
    int32_t* si = I.internal<int32_t>(I.topk_i, 2 * half + n_out, I.topk_i_cap);
    I.reserve_out(n_out * (sizeof(float) + sizeof(int32_t)));
    std::byte* out = I.pin_out->data();
    const float* dx = x.data();
    float* ov = sv + 2 * half;
    int32_t* oi = si + 2 * half;
    I.sig("top_k", dx, rows, n, k, sv, si, out);
    I.record("top_k", [=](cudaStream_t st) {
      if (cudaError_t e = cuda::launch_top_k(dx, rows, n, k, sv, si, ov, oi, st); e != cudaSuccess)
        return e;
      if (cudaError_t e = cudaMemcpyAsync(out, ov, n_out * sizeof(float), cudaMemcpyDeviceToHost, st);
          e != cudaSuccess)
        return e;
      return cudaMemcpyAsync(out + n_out * sizeof(float), oi, n_out * sizeof(int32_t),
                             cudaMemcpyDeviceToHost, st);
    });
    I.flush();
    std::memcpy(vals.data(), out, n_out * sizeof(float));
    std::memcpy(ids.data(), out + n_out * sizeof(float), n_out * sizeof(int32_t));
    return;
  }
  I.begin_host_op({}, "top_k");
  const float* dx = I.upload<float>(0, x);
  float* sv = I.buffer<float>(1, 2 * half + n_out);
  int32_t* si = I.buffer<int32_t>(2, 2 * half + n_out);
  I.launch("top_k", [&] {
    return cuda::launch_top_k(dx, rows, n, k, sv, si, sv + 2 * half, si + 2 * half, I.s());
  });
  I.download(vals, static_cast<const float*>(sv + 2 * half));
  I.download(ids, static_cast<const int32_t*>(si + 2 * half));
  I.finish("top_k");
}

void CudaBackend::all_reduce_sum(std::span<float> x) {
#if KILN_HAVE_NCCL
  Impl& I = *impl_;
  if (I.comm == nullptr || x.empty()) return;
  std::lock_guard lock(I.mu);
  I.enter();
  KILN_CHECK(I.is_dev(x.data()), "cuda all_reduce_sum of host memory (a group's ranks compute "
             "resident)");
  float* d = x.data();
  const size_t n = x.size();
  ncclComm_t comm = I.comm;
  I.sig("all_reduce", d, n);
  // NCCL calls are captured into the segment's graph like kernels (NCCL supports stream
  // capture); every rank records the same sequence, so the graphs match across ranks.
  I.record("all_reduce", [=](cudaStream_t st) {
    const ncclResult_t r = ncclAllReduce(d, d, n, ncclFloat, ncclSum, comm, st);
    if (r != ncclSuccess) {
      log_notice("cuda: ncclAllReduce of {} floats: {}", n, ncclGetErrorString(r));
      return cudaErrorUnknown;
    }
    return cudaSuccess;
  });
#else
  (void)x;
#endif
}

Expected<std::unique_ptr<Backend>> make_cuda_tp_group(int n, const CudaOptions& options) {
  if (n < 1) return Status::errorf("--tensor-parallel {}: must be at least 1", n);
#if KILN_HAVE_NCCL
  const int have = cuda_device_count();
  if (have < n)
    return Status::errorf("--tensor-parallel {} needs {} CUDA devices, {} present", n, n, have);
  // NVLink multicast (NVLS) can take a shared host's GPUs out of service; kiln never needs it,
  // so it is off in every process that makes a group, whatever the environment said.
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/1);
  std::vector<std::unique_ptr<Backend>> ranks;
  std::vector<CudaBackend::Impl*> impls;
  for (int r = 0; r < n; ++r) {
    CudaOptions o = options;
    o.device = r;
    o.weight_region = {};  // each rank uploads its own shard's weights on first use
    o.zero_copy = false;
    auto be = make_cuda_backend(o);
    if (!be) return be.status().context(fmt::format("tensor-parallel rank {}", r));
    impls.push_back((*be)->impl_.get());
    ranks.push_back(std::move(*be));
  }
  std::vector<ncclComm_t> comms(static_cast<size_t>(n));
  std::vector<int> devs(static_cast<size_t>(n));
  std::iota(devs.begin(), devs.end(), 0);
  if (ncclResult_t r = ncclCommInitAll(comms.data(), n, devs.data()); r != ncclSuccess)
    return Status::errorf("NCCL: ncclCommInitAll over {} GPUs: {}", n, ncclGetErrorString(r));
  for (int r = 0; r < n; ++r) impls[static_cast<size_t>(r)]->comm = comms[static_cast<size_t>(r)];
  return std::unique_ptr<Backend>(std::make_unique<TpGroup>(std::move(ranks)));
#else
  (void)options;
  if (n == 1) return Status::error("--tensor-parallel: this kiln was built without NCCL");
  return Status::errorf("--tensor-parallel {}: this kiln was built without NCCL", n);
#endif
}

namespace {
// CudaOptions' ranges, checked once at creation: one line naming the option and the range.
Status validate(const CudaOptions& o) {
  if (o.auto_int8_max_tokens < 1 || o.auto_int8_max_tokens > cuda::kQ8MaxTokens)
    return Status::errorf("cuda: int8 matmul token limit {} (1..{})", o.auto_int8_max_tokens,
                          cuda::kQ8MaxTokens);
  if (o.int8_mma_min_tokens < 0 || o.int8_mma_min_tokens > cuda::kQ8MaxTokens)
    return Status::errorf("cuda: int8 tensor-core token threshold {} (0..{}; 0: never)",
                          o.int8_mma_min_tokens, cuda::kQ8MaxTokens);
  if (o.graph_kv_bucket < 1)
    return Status::errorf("cuda: graph KV bucket {} keys (at least 1; 1: no padding)",
                          o.graph_kv_bucket);
  return Status::ok();
}
}  // namespace

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error for later calls
    return 0;
  }
  return n;
}

Expected<std::unique_ptr<CudaBackend>> make_cuda_backend(const CudaOptions& options) {
  int n = 0;
  if (cudaError_t e = cudaGetDeviceCount(&n); e != cudaSuccess) {
    cudaGetLastError();
    return Status::errorf("no CUDA device: {}", cudaGetErrorString(e));
  }
  if (n == 0) return Status::error("no CUDA device: the driver reports none");
  if (options.device < 0 || options.device >= n)
    return Status::errorf("CUDA device {} does not exist ({} present)", options.device, n);
  KILN_TRY(validate(options));
  auto impl = std::make_unique<CudaBackend::Impl>(options);
  if (cudaError_t e = cudaSetDevice(options.device); e != cudaSuccess)
    return Status::errorf("CUDA device {}: {}", options.device, cudaGetErrorString(e));
  cudaDeviceProp prop{};
  if (cudaError_t e = cudaGetDeviceProperties(&prop, options.device); e != cudaSuccess)
    return Status::errorf("CUDA device {}: {}", options.device, cudaGetErrorString(e));
  impl->n_sm = prop.multiProcessorCount;
  impl->device_name =
      fmt::format("{} (sm_{}{}, {} SMs, {:.1f} GiB)", prop.name, prop.major, prop.minor,
                  prop.multiProcessorCount, prop.totalGlobalMem / 1073741824.0);
  if (prop.major < 9)
    return Status::errorf("CUDA device {} is {} but kiln is built for sm_90", options.device,
                          impl->device_name);
  if (cudaError_t e = impl->compute.create(); e != cudaSuccess)
    return Status::errorf("CUDA stream: {}", cudaGetErrorString(e));
  if (cudaError_t e = impl->copy.create(); e != cudaSuccess)
    return Status::errorf("CUDA stream: {}", cudaGetErrorString(e));
  impl->profile = options.profile;
  if (impl->gemm_graphs()) impl->gemm.use_fixed_workspace();
  if (options.l2_prefetch_bytes > 0) {
    if (cudaError_t e = impl->side.create(); e != cudaSuccess)
      return Status::errorf("CUDA stream: {}", cudaGetErrorString(e));
    for (cuda::Event* ev : {&impl->fork_ev, &impl->join_ev})
      if (cudaError_t e = ev->create(); e != cudaSuccess)
        return Status::errorf("CUDA event: {}", cudaGetErrorString(e));
    // Hinted bytes not yet read stay within 3/4 of the L2: the matvec that reads them, and
    // the small ops before it, keep the rest.
    impl->l2_plan.emplace(options.l2_prefetch_bytes, size_t(prop.l2CacheSize) / 4 * 3);
  }
  if (cudaError_t e = impl->expert_copy_ev.create(); e != cudaSuccess)
    return Status::errorf("CUDA event: {}", cudaGetErrorString(e));
  if (options.profile) {
    for (cuda::Event& e : impl->ev)
      if (cudaError_t err = e.create(/*timing=*/true); err != cudaSuccess)
        return Status::errorf("CUDA event: {}", cudaGetErrorString(err));
    impl->profile_events = true;
  }
  impl->arena = std::make_unique<cuda::WeightArena>(impl->copy.get(), options.arena_chunk_bytes,
                                                    options.verify_weight_cache);
  KILN_TRY(impl->arena->init());
  bool placed = false;
  if (options.zero_copy && !options.weight_region.empty()) {
    const Status reg = impl->arena->register_region(options.weight_region);
    if (reg) {
      placed = true;
    } else {
      log_notice("cuda: zero-copy weights unavailable ({}); uploading them to the device",
                 reg.message());
    }
  }
  if (!placed) KILN_TRY(impl->arena->upload_region(options.weight_region, options.progress));
  // Resident ops wait on the host for arena uploads made after this point (weights_ready).
  if (cudaError_t e = cudaEventSynchronize(impl->arena->ready()); e != cudaSuccess)
    return Status::errorf("cuda: weight upload: {}", cudaGetErrorString(e));
  impl->uploads_seen = impl->arena->stats().uploads;
  return std::make_unique<CudaBackend>(std::move(impl));
}

}  // namespace kiln
