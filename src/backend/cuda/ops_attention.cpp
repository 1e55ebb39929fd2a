// backend/cuda/ops_attention.cpp: the op table's attention and KV-plane stores (cuda_backend.h):
// attention, attention_batch (the split-kernel sequences of a decode step in one launch pair),
// store_rows_f16 and store_rows_f16_batch, resident or on host spans.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <span>
#include <vector>

#include "backend/cuda/backend_impl.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_util.h"
#include "backend/cuda/kernels.h"
#include "core/check.h"
#include "core/log.h"

namespace kiln {

using cuda::check_cuda;

namespace {
void check_attention_args(const AttentionArgs& a) {
  KILN_CHECK(a.sinks.empty() || static_cast<int64_t>(a.sinks.size()) == a.n_head);
  KILN_CHECK(a.n_head > 0 && a.n_head_kv > 0 && a.n_head % a.n_head_kv == 0);
  KILN_CHECK(a.head_dim > 0 && a.head_dim <= kCudaMaxHeadDim,
             "cuda attention: head_dim {} (at most {})", a.head_dim, kCudaMaxHeadDim);
  KILN_CHECK(a.head_dim <= kCudaNarrowHeadDim || a.head_dim % 8 == 0,
             "cuda attention: head_dim {} above {} must be a multiple of 8", a.head_dim,
             kCudaNarrowHeadDim);
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
// Heads wider than kCudaNarrowHeadDim have only the wide kernel, planned as warp tiles
// whatever the option (on planes it cannot serve, the launch fails).
cuda::DeviceAttention attention_shape(const AttentionArgs& a, int64_t n_kv, bool warp_tiles) {
  static_assert(kCudaMaxHeadDim == cuda::kAttentionMaxHeadDim);
  cuda::DeviceAttention d;
  d.warp_tiles = a.head_dim > kCudaNarrowHeadDim ||
                 (warp_tiles && cuda::attention_warp_tiles_fit(a.head_dim, a.k.data(), a.v.data()));
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

// Queries of one sequence up to this many (a speculative verify batch, a short prefill chunk)
// run one query per plan item, each over its visible prefix of the key list: the plan (splits
// over keys, padding) is then the one a one-query decode step at that position gets, so a
// token's attention has the same bits whether it is verified in a batch of drafts or decoded
// alone (what speculative decoding needs for greedy ids equal to plain greedy's; where the rest
// of a step stands: docs/determinism.md). Longer prefills share one plan.
constexpr int64_t kQueryInvariantMaxQ = 16;

// Whether a takes split_queries: 2..kQueryInvariantMaxQ queries, row lists in host memory and
// key positions ascending (then the keys query i sees, kv_pos <= q_pos[i], are a prefix: the
// list a decode step at q_pos[i] holds).
template <class Memory>
bool splits_queries(const AttentionArgs& a, const Memory& mem) {
  return a.n_q > 1 && a.n_q <= kQueryInvariantMaxQ && !mem.is_dev(a.kv_pos.data()) &&
         !mem.is_dev(a.q_pos.data()) && !mem.is_dev(a.kv_rows.data()) &&
         std::is_sorted(a.kv_pos.begin(), a.kv_pos.end());
}

// a as one-query items, each over its visible prefix of the keys, appended to `out`.
void split_queries(const AttentionArgs& a, std::vector<AttentionArgs>& out) {
  const auto w = static_cast<size_t>(a.n_head * a.head_dim);
  for (int64_t i = 0; i < a.n_q; ++i) {
    const auto qi = static_cast<size_t>(i);
    AttentionArgs one = a;
    const auto visible = static_cast<size_t>(
        std::upper_bound(a.kv_pos.begin(), a.kv_pos.end(), a.q_pos[qi]) - a.kv_pos.begin());
    one.q = a.q.subspan(qi * w, w);
    one.out = a.out.subspan(qi * w, w);
    one.q_pos = a.q_pos.subspan(qi, 1);
    one.kv_rows = a.kv_rows.first(visible);
    one.kv_pos = a.kv_pos.first(visible);
    one.n_q = 1;
    out.push_back(one);
  }
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
  I.enter();
  // A host plane goes to the device whole and comes back whole (host_span.h): the rows not
  // stored keep their bytes.
  auto* dplane = reinterpret_cast<uint16_t*>(I.host.inout(plane).data());
  I.seg.room(I.float_room(src) + I.seg.host_bytes(rows));
  const float* dsrc = I.floats(src);
  const int32_t* drows = I.seg.ints(rows);
  const auto nr = static_cast<int64_t>(rows.size());
  I.seg.sig("store_rows_f16", dsrc, width, drows, nr, dplane);
  I.seg.record("store_rows_f16", [=](cudaStream_t st) {
    return cuda::launch_store_rows_f16(dsrc, width, drows, nr, dplane, st);
  });
  I.host.done();
}

// The sequences that take the split kernel run as one launch pair (plan_attention_batch gives
// each the plan it would get alone, so each out has attention()'s bits); prefill-sized ones
// (the tile kernel) and host-span calls run one attention() each.
void CudaBackend::attention_batch(std::span<const AttentionArgs> seqs_in) {
  Impl& I = *impl_;
  std::vector<const AttentionArgs*> batched;
  std::vector<AttentionArgs> expanded;  // seqs_in with short query runs one query per item
  {
    std::lock_guard lock(I.mu);
    for (const AttentionArgs& a : seqs_in) {
      check_attention_args(a);
      if (splits_queries(a, I.mem))
        split_queries(a, expanded);
      else
        expanded.push_back(a);
    }
  }
  const std::span<const AttentionArgs> seqs = expanded;
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
      if (same_kernel && I.mem.is_dev(a.out.data()) && I.mem.is_dev(a.k.data()) &&
          I.mem.is_dev(a.v.data()) && a.n_q > 0 && !a.kv_rows.empty() && a.head_dim % 2 == 0 &&
          a.n_head == a0.n_head && a.n_head_kv == a0.n_head_kv && a.head_dim == a0.head_dim &&
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
    pads[i] = I.seg.kv_pad(n_kv);  // exactly as attention() pads it alone
    cuda::DeviceAttention& d = items[i].a;
    d = attention_shape(a, std::max<int64_t>(n_kv, static_cast<int64_t>(pads[i])),
                        I.opts.attention_warp_tiles);
    part_floats += cuda::attention_scratch_floats(d, I.n_sm);
    room += I.float_room(a.q) + I.float_room(a.sinks) + I.seg.host_bytes(a.kv_rows, pads[i]) +
            I.seg.host_bytes(a.kv_pos, pads[i]) + I.seg.host_bytes(a.q_pos);
  }
  // Scratch first (growing it flushes), then every staged array and the table.
  float* part = I.internal<float>(I.attn_part, part_floats, I.attn_cap);
  I.seg.room(room + items.size() * sizeof(cuda::AttentionBatchItem) + 16);
  size_t off = 0;
  for (size_t i = 0; i < batched.size(); ++i) {
    const AttentionArgs& a = *batched[i];
    cuda::DeviceAttention& d = items[i].a;
    d.q = I.floats(a.q);
    d.sinks = a.sinks.empty() ? nullptr : I.floats(a.sinks);
    d.k = reinterpret_cast<const uint16_t*>(a.k.data());
    d.v = reinterpret_cast<const uint16_t*>(a.v.data());
    d.kv_rows = I.seg.ints(a.kv_rows, pads[i], 0);
    d.kv_pos = I.seg.ints(a.kv_pos, pads[i], INT32_MAX);
    d.q_pos = I.seg.ints(a.q_pos);
    items[i].part = part + off;
    off += cuda::attention_scratch_floats(d, I.n_sm);
  }
  cuda::plan_attention_batch(items, I.n_sm);
  const auto* table = reinterpret_cast<const cuda::AttentionBatchItem*>(
      I.seg.stage(items.data(), items.size() * sizeof(cuda::AttentionBatchItem),
                  items.size() * sizeof(cuda::AttentionBatchItem)));
  I.seg.sig("attention_batch", table, items.size(), part);
  for (const cuda::AttentionBatchItem& it : items) {
    const cuda::DeviceAttention& d = it.a;
    I.seg.sig("attention_batch", d.q, d.k, d.v, d.kv_rows, d.kv_pos, d.q_pos, d.n_q, d.n_kv,
              d.n_head, d.n_head_kv, d.head_dim, d.window, d.scale, d.softcap, d.out, d.warp_tiles,
              d.sinks);
  }
  if (I.prof.on()) I.seg.label(fmt::format("attention x{} sequences (one launch)", items.size()));
  I.seg.record("attention_batch",
               [=](cudaStream_t st) { return cuda::launch_attention_batch(table, items, st); });
}

void CudaBackend::store_rows_f16_batch(std::span<const StoreRowsTask> tasks) {
  Impl& I = *impl_;
  bool resident = tasks.size() > 1 && tasks.size() <= 65535;
  {
    std::lock_guard lock(I.mu);
    for (const StoreRowsTask& t : tasks) {
      check_store_rows(t.src, t.width, t.rows, t.plane);
      resident = resident && I.mem.is_dev(t.plane.data());
    }
  }
  if (!resident) {
    Backend::store_rows_f16_batch(tasks);
    return;
  }
  std::lock_guard lock(I.mu);
  I.enter();
  size_t room = tasks.size() * sizeof(cuda::StoreRowsItem) + 16;
  for (const StoreRowsTask& t : tasks) room += I.float_room(t.src) + I.seg.host_bytes(t.rows);
  I.seg.room(room);
  std::vector<cuda::StoreRowsItem> items(tasks.size());
  int64_t most = 0;
  for (size_t i = 0; i < tasks.size(); ++i) {
    const StoreRowsTask& t = tasks[i];
    items[i].src = I.floats(t.src);
    items[i].rows = I.seg.ints(t.rows);
    items[i].n_rows = static_cast<int64_t>(t.rows.size());
    items[i].width = t.width;
    items[i].plane = reinterpret_cast<uint16_t*>(t.plane.data());
    most = std::max(most, items[i].n_rows * t.width);
  }
  const auto* table = reinterpret_cast<const cuda::StoreRowsItem*>(
      I.seg.stage(items.data(), items.size() * sizeof(cuda::StoreRowsItem),
                  items.size() * sizeof(cuda::StoreRowsItem)));
  I.seg.sig("store_rows_f16_batch", table, items.size(), most);
  for (const cuda::StoreRowsItem& it : items)
    I.seg.sig("store_rows_f16_batch", it.src, it.rows, it.n_rows, it.width, it.plane);
  const int n = static_cast<int>(items.size());
  if (I.prof.on()) I.seg.label(fmt::format("store_rows_f16 x{} (one launch)", n));
  I.seg.record("store_rows_f16_batch", [=](cudaStream_t st) {
    return cuda::launch_store_rows_f16_batch(table, n, most, st);
  });
}

void CudaBackend::attention(const AttentionArgs& args) {
  check_attention_args(args);
  Impl& I = *impl_;
  bool split = false;
  {
    std::lock_guard lock(I.mu);
    split = splits_queries(args, I.mem);
  }
  // One query per plan item (split_queries), through attention_batch's launch.
  if (split) return attention_batch(std::span<const AttentionArgs>(&args, 1));
  const int64_t n_kv = static_cast<int64_t>(args.kv_rows.size());
  std::lock_guard lock(I.mu);
  I.enter();
  // Host spans (host_span.h): the KV planes and the output get device twins; q, the row lists
  // and the sinks are staged as for any resident call.
  KILN_CHECK(!I.mem.is_dev(args.out.data()) ||
                 (I.mem.is_dev(args.k.data()) && I.mem.is_dev(args.v.data())),
             "cuda attention: device output needs device KV planes");
  AttentionArgs a = args;
  a.k = I.host.in(args.k);
  a.v = I.host.in(args.v);
  a.out = I.host.out(args.out);
  const size_t pad_n = I.seg.kv_pad(n_kv);
  cuda::DeviceAttention d = attention_shape(a, std::max<int64_t>(n_kv, static_cast<int64_t>(pad_n)),
                                            I.opts.attention_warp_tiles);
  // Scratch first: growing it flushes, which restarts staging, so nothing may be staged for
  // this op before (the staged pointers would then name reused staging space).
  float* part =
      I.internal<float>(I.attn_part, cuda::attention_scratch_floats(d, I.n_sm), I.attn_cap);
  I.seg.room(I.float_room(a.q) + I.float_room(a.sinks) + I.seg.host_bytes(a.kv_rows, pad_n) +
             I.seg.host_bytes(a.kv_pos, pad_n) + I.seg.host_bytes(a.q_pos));
  d.q = I.floats(a.q);
  d.sinks = a.sinks.empty() ? nullptr : I.floats(a.sinks);
  d.k = reinterpret_cast<const uint16_t*>(a.k.data());
  d.v = reinterpret_cast<const uint16_t*>(a.v.data());
  d.kv_rows = I.seg.ints(a.kv_rows, pad_n, 0);
  d.kv_pos = I.seg.ints(a.kv_pos, pad_n, INT32_MAX);
  d.q_pos = I.seg.ints(a.q_pos);
  const int n_sm = I.n_sm;
  I.seg.sig("attention", d.q, d.k, d.v, d.kv_rows, d.kv_pos, d.q_pos, d.n_q, d.n_kv, d.n_head,
            d.n_head_kv, d.head_dim, d.window, d.scale, d.softcap, d.out, part, d.warp_tiles,
            d.sinks);
  I.seg.record("attention",
               [=](cudaStream_t st) { return cuda::launch_attention(d, part, n_sm, st); });
  I.host.done();
}

}  // namespace kiln
