// backend/backend.h: the op table every backend implements (ref = scalar oracle, cpu =
// Highway SIMD + threads, cuda later, metal planned). The model layer builds forward passes
// only from these ops and never knows which backend runs them; backends never know models.
//
// Conventions: activations are f32, row-major, [n_tok][width]; weight matrices follow ggml:
// `n_cols` (= k, ne[0]) elements per stored row, `n_rows` (ne[1]) output features. KV planes
// are f16, [n_phys_rows][n_head_kv * head_dim]. All spans are borrowed; sizes are checked
// with KILN_CHECK (a mismatch is a programming error, not bad input).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <new>
#include <numbers>
#include <numeric>
#include <span>
#include <string_view>
#include <vector>

#include "core/check.h"
#include "core/dtype.h"
#include "core/half.h"

namespace kiln {

// A borrowed 2-D weight matrix in any dtype the quant layer can read.
struct WeightMatrix {
  DType dtype = DType::F32;
  int64_t n_cols = 0;    // k: elements per stored row (ne[0])
  int64_t n_rows = 0;    // output features (ne[1] * ne[2] * ne[3] flattened)
  size_t row_bytes = 0;  // bytes per stored row
  // Bytes from one stored row to the next; 0 means row_bytes (rows back to back). Larger for a
  // column block of a wider matrix (columns()), which tensor parallelism's row-parallel
  // shards are: views into the mapping, never repacked on the host.
  size_t row_stride = 0;
  std::span<const std::byte> bytes;  // from row 0's first byte to the last row's last byte
  // Nonzero: names the bytes' content, for memory that later holds other bytes at the same
  // address (a streamed MoE expert slab, moe/expert_store.h). Device backends cache such a
  // matrix by this key instead of by address. 0: the address names the content (views of the
  // read-only mapping, which never changes).
  uint64_t content_key = 0;

  size_t stride() const { return row_stride ? row_stride : row_bytes; }
  bool strided() const { return stride() != row_bytes; }
  // What `bytes` must span for this shape.
  size_t span_bytes() const {
    return n_rows > 0 ? static_cast<size_t>(n_rows - 1) * stride() + row_bytes : 0;
  }
  std::span<const std::byte> row(int64_t r) const {
    return bytes.subspan(static_cast<size_t>(r) * stride(), row_bytes);
  }
  // Rows [first, first + count) as a matrix of their own (an expert's slice of a 3-D tensor).
  WeightMatrix rows(int64_t first, int64_t count) const {
    WeightMatrix m = *this;
    m.n_rows = count;
    m.content_key = sub_key(1, first, count);
    m.bytes = count > 0 ? bytes.subspan(static_cast<size_t>(first) * stride(),
                                        static_cast<size_t>(count - 1) * stride() + row_bytes)
                        : bytes.subspan(0, 0);
    return m;
  }
  // Columns [first, first + count) of every row as a strided matrix: both must be multiples
  // of the type's block (whole quant blocks per row). KILN_CHECK on a misaligned request.
  WeightMatrix columns(int64_t first, int64_t count) const {
    const int64_t blk = traits(dtype).block_size;
    KILN_CHECK(
        first >= 0 && count > 0 && first + count <= n_cols && first % blk == 0 && count % blk == 0,
        "columns [{}, +{}) of a {}-wide {} matrix (block {})", first, count, n_cols,
        dtype_name(dtype), blk);
    const size_t bpb = traits(dtype).type_size;  // bytes per block
    WeightMatrix m = *this;
    m.n_cols = count;
    m.row_stride = stride();
    m.row_bytes = static_cast<size_t>(count / blk) * bpb;
    m.bytes = bytes.subspan(static_cast<size_t>(first / blk) * bpb, m.span_bytes());
    m.content_key = sub_key(2, first, count);
    return m;
  }

 private:
  // A part of keyed content gets a key of its own (0 stays 0).
  uint64_t sub_key(uint64_t kind, int64_t first, int64_t count) const {
    if (content_key == 0) return 0;
    uint64_t h = content_key ^ (kind * 0x9E3779B97F4A7C15ull);
    for (uint64_t v : {static_cast<uint64_t>(first), static_cast<uint64_t>(count)})
      h = (h ^ v) * 0x100000001B3ull;
    return h | 1;  // never 0
  }
};

enum class RopeStyle {
  Normal,  // rotate adjacent pairs (x[2i], x[2i+1]): llama, GPT-J
  NeoX,    // rotate (x[i], x[i + n_rot/2]): qwen2/3, gemma, NeoX
};

// Rotary position embedding of pair i (0 <= i < n_rot / 2) at position pos, as llama.cpp's
// ggml_rope_ext computes it:
//   theta_extrap = pos * base^(-2i/n_rot) / freq_factors[i]     (factors: 1 when empty)
//   theta_interp = freq_scale * theta_extrap
//   theta = theta_interp                                          (ext_factor == 0)
//   theta = theta_interp * (1 - r) + theta_extrap * r,  r = ramp(i) * ext_factor   (YaRN)
//   (cos, sin) scaled by attn_factor, times 1 + 0.1 ln(1 / freq_scale) when ext_factor != 0
// ramp(i) falls from 1 to 0 between the YaRN correction dims (rope_yarn_corr_dims below).
struct RopeParams {
  int64_t n_rot = 0;        // leading dims of each head that rotate (<= head_dim, even)
  float freq_base = 10000;  // theta_i = pos * freq_scale * base^(-2i/n_rot)
  float freq_scale = 1;
  RopeStyle style = RopeStyle::Normal;
  // [n_rot / 2] divisors of each pair's frequency (Llama 3 rope_freqs, LongRoPE factors), or
  // empty. Borrowed: the model's weights outlive every op that reads them.
  std::span<const float> freq_factors = {};
  float ext_factor = 0;   // YaRN: weight of the extrapolation ramp (0: no YaRN)
  float attn_factor = 1;  // magnitude scale of cos and sin
  float beta_fast = 32;   // YaRN: correction dims from these rotation counts ...
  float beta_slow = 1;
  int32_t n_ctx_orig = 0;  // ... over the original training context (> 0 with ext_factor)

  bool plain() const { return freq_factors.empty() && ext_factor == 0 && attn_factor == 1; }
};

// The host-side constants every backend derives from RopeParams once per op: YaRN's
// correction dims (llama.cpp's ggml_rope_yarn_corr_dims, in f32 as there) and the cos/sin
// magnitude.
struct RopeYarnTerms {
  float corr_lo = 0, corr_hi = 0;  // ramp(i) = 1 - clamp((i - lo) / max(0.001, hi - lo), 0, 1)
  float ext_factor = 0;
  float mscale = 1;
};
inline RopeYarnTerms rope_yarn_terms(const RopeParams& p) {
  RopeYarnTerms t;
  t.ext_factor = p.ext_factor;
  t.mscale = p.attn_factor;
  if (p.ext_factor == 0) return t;
  // Dimension (of n_rot) whose wavelength turns n_rot_turns times over the original context.
  auto corr_dim = [&](float n_rot_turns) {
    return float(p.n_rot) *
           std::log(float(p.n_ctx_orig) / (n_rot_turns * 2 * std::numbers::pi_v<float>)) /
           (2 * std::log(p.freq_base));
  };
  t.corr_lo = std::max(0.0f, std::floor(corr_dim(p.beta_fast)));
  t.corr_hi = std::min(float(p.n_rot - 1), std::ceil(corr_dim(p.beta_slow)));
  t.mscale *= 1.0f + 0.1f * std::log(1.0f / p.freq_scale);
  return t;
}
// Pair i's angle per unit of position (theta = pos * rope_pair_freq): the factored form of the
// formula above, shared by the host backends so their angles agree bit for bit.
inline double rope_pair_freq(const RopeParams& p, const RopeYarnTerms& y, int64_t i) {
  double f = std::pow(double(p.freq_base), -2.0 * double(i) / double(p.n_rot));
  if (!p.freq_factors.empty()) f /= double(p.freq_factors[static_cast<size_t>(i)]);
  if (y.ext_factor == 0) return double(p.freq_scale) * f;
  const float ramp_y = (float(i) - y.corr_lo) / std::max(0.001f, y.corr_hi - y.corr_lo);
  const double r = double(1 - std::min(1.0f, std::max(0.0f, ramp_y))) * double(y.ext_factor);
  return f * (double(p.freq_scale) * (1 - r) + r);
}

// Causal attention over f16 KV planes read through a logical->physical row map, so growing
// planes, rings and several sequences all look the same to the kernel.
struct AttentionArgs {
  std::span<const float> q;          // [n_q][n_head * head_dim]
  std::span<const f16> k;            // plane [n_phys][n_head_kv * head_dim]
  std::span<const f16> v;            // plane [n_phys][n_head_kv * head_dim]
  std::span<const int32_t> kv_rows;  // [n_kv] physical row of each candidate key
  std::span<const int32_t> kv_pos;   // [n_kv] position of each candidate key
  std::span<const int32_t> q_pos;    // [n_q] position of each query
  int64_t n_q = 0, n_head = 0, n_head_kv = 0, head_dim = 0;
  int32_t window = 0;  // > 0: key visible iff q_pos - kv_pos < window (sliding window)
  float scale = 1;     // logit scale, usually 1/sqrt(head_dim)
  float softcap = 0;   // > 0: logit = softcap * tanh(logit / softcap)
  // [n_head] or empty: attention sinks (gpt-oss), one extra logit per head that joins the
  // softmax's max and denominator but has no value row (llama.cpp's soft_max / flash-attn
  // sinks). Host memory (weights); a query with no visible key still produces zeros.
  std::span<const float> sinks;
  std::span<float> out;  // [n_q][n_head * head_dim]
  // Key j is visible to query i iff kv_pos[j] <= q_pos[i] (and the window rule). A query
  // with no visible key produces zeros.
};

// Bytes a backend allocated for its ops to compute in (forward scratch, KV planes), freed by
// the deleter the backend chose. Must not outlive the backend that made it.
using BackendBytes = std::unique_ptr<std::byte[], std::function<void(std::byte*)>>;

// A typed view over BackendBytes: host memory on host backends (ref, cpu), device memory on a
// device backend (cuda), where host code must not dereference span() and crosses only through
// Backend::upload/download. Zero-filled when allocated.
template <typename T>
class BackendBuffer {
 public:
  BackendBuffer() = default;
  BackendBuffer(BackendBytes bytes, size_t n) : bytes_(std::move(bytes)), n_(n) {}
  std::span<T> span() const { return {reinterpret_cast<T*>(bytes_.get()), n_}; }
  T* data() const { return reinterpret_cast<T*>(bytes_.get()); }
  size_t size() const { return n_; }
  bool empty() const { return n_ == 0; }

 private:
  BackendBytes bytes_;
  size_t n_ = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const = 0;
  // True when a token's results do not depend on how many tokens share its forward step
  // (docs/determinism.md): the CPU and reference backends. A backend whose kernels change with
  // the step's token count (CUDA: cuBLAS above 16 tokens, other float kernels above 8) says
  // false, and generation then gives the prompt's last token a step of its own, as speculative
  // decoding does (Session::prefill_head), so plain and speculative greedy ids agree.
  virtual bool batch_invariant() const { return true; }
  // True when MoE steps of a few tokens (2 to 8: a speculative verify, a few sequences decoding
  // together) should run the experts any token chose as grouped gate/up batches over all the
  // step's tokens (model/forward.cpp moe_few_tokens: fewer, larger ops, unused rows computed)
  // instead of the general path's ops per expert; either way the same bits where each token's
  // matmul row is that of a one-token call. Host backends: false (on the CPU the unused rows
  // cost more than the ops saved).
  virtual bool groups_few_token_experts() const { return false; }

  // --- Memory the ops compute in. Host backends keep the defaults below (plain host memory,
  // memcpy); a device backend overrides all of them. Every op accepts spans of this memory.
  //
  // True when alloc_bytes() returns memory host code must not touch.
  virtual bool device_memory() const { return false; }
  // Device backends: the bytes of device memory still free for buffers (the KV planes grow into
  // it as positions arrive, so the scheduler checks a context against it at load); 0 where the
  // backend cannot tell. Host backends: 0 (host planes are checked against MemAvailable).
  virtual uint64_t device_free_bytes() const { return 0; }
  // `bytes` zero-filled bytes, 64-byte aligned.
  virtual BackendBytes alloc_bytes(size_t bytes) {
    const size_t n = std::max<size_t>(bytes, 1);
    auto* p = static_cast<std::byte*>(::operator new[](n, std::align_val_t(64)));
    std::memset(p, 0, n);
    return BackendBytes(p, [](std::byte* q) { ::operator delete[](q, std::align_val_t(64)); });
  }
  // host -> backend memory. The host bytes may be reused as soon as the call returns.
  virtual void upload_bytes(std::span<const std::byte> host, std::span<std::byte> dst) {
    std::copy(host.begin(), host.end(), dst.begin());
  }
  // backend memory -> host; waits for every op issued before it.
  virtual void download_bytes(std::span<const std::byte> src, std::span<std::byte> host) {
    std::copy(src.begin(), src.end(), host.begin());
  }
  // Within backend memory (regions must not overlap), ordered with the ops around it.
  virtual void copy_bytes(std::span<const std::byte> src, std::span<std::byte> dst) {
    std::copy(src.begin(), src.end(), dst.begin());
  }
  virtual void zero_bytes(std::span<std::byte> dst) {
    std::fill(dst.begin(), dst.end(), std::byte{0});
  }
  // `rows` rows of `width` bytes, row r at src + r * src_pitch to dst + r * dst_pitch, as one
  // op (a gather of columns: on a GPU one copy instead of one per row). Backend memory both; no
  // destination row may overlap a source row. Callers check the spans (copy_2d).
  virtual void copy_bytes_2d(const std::byte* src, size_t src_pitch, std::byte* dst,
                             size_t dst_pitch, size_t width, size_t rows) {
    for (size_t r = 0; r < rows; ++r)
      std::copy(src + r * src_pitch, src + r * src_pitch + width, dst + r * dst_pitch);
  }
  // dst row i = src row ids[i] (rows of `width` floats), as one op: on a GPU one launch, not
  // a copy per row. ids in host memory. Callers check the spans (gather_rows).
  virtual void gather_rows_f32(std::span<const float> src, int64_t width,
                               std::span<const int32_t> ids, std::span<float> dst) {
    const auto W = static_cast<size_t>(width);
    for (size_t i = 0; i < ids.size(); ++i)
      copy(src.subspan(static_cast<size_t>(ids[i]) * W, W), dst.subspan(i * W, W));
  }
  // For i in order: src row i scaled by scales[i] in place (scale()), then added to out row
  // ids[i] (add()): those two ops' bits, as one op. ids (distinct) and scales in host memory.
  // Callers check the spans (scale_add_rows).
  virtual void scale_add_rows_f32(std::span<float> src, int64_t width, std::span<const int32_t> ids,
                                  std::span<const float> scales, std::span<float> out) {
    const auto W = static_cast<size_t>(width);
    for (size_t i = 0; i < ids.size(); ++i) {
      const std::span<float> row = src.subspan(i * W, W);
      const std::span<float> orow = out.subspan(static_cast<size_t>(ids[i]) * W, W);
      scale(row, scales[i]);
      add(orow, row, orow);
    }
  }
  // Waits until every op issued so far has finished (a no-op on host backends).
  virtual void synchronize() {}
  // Registers host memory that weights will be copied from (page-locked on CUDA, so copies
  // of streamed expert slabs run as DMA), for as long as the returned handle lives; its
  // release unregisters synchronously. nullptr: nothing registered (a host backend, or the
  // driver refused: copies then read pageable memory, slower but the same bytes).
  virtual std::shared_ptr<void> register_host_memory(std::span<std::byte> /*mem*/) {
    return nullptr;
  }
  // Streaming read bandwidth of the backend's own memory in GB/s, measured when called (a
  // device's memory: the roofline of a weight-bound decode); 0 on host backends, whose
  // callers measure host RAM themselves.
  virtual double read_bandwidth_gbps() { return 0; }

  template <typename T>
  BackendBuffer<T> alloc(size_t n) {
    return BackendBuffer<T>(alloc_bytes(n * sizeof(T)), n);
  }
  template <typename T>
  void upload(std::span<const T> host, std::span<T> dst) {
    KILN_CHECK(dst.size() >= host.size(), "upload of {} into {}", host.size(), dst.size());
    upload_bytes(std::as_bytes(host), std::as_writable_bytes(dst.first(host.size())));
  }
  template <typename T>
  void download(std::span<const T> src, std::span<T> host) {
    KILN_CHECK(host.size() >= src.size(), "download of {} into {}", src.size(), host.size());
    download_bytes(std::as_bytes(src), std::as_writable_bytes(host.first(src.size())));
  }
  template <typename T>
  void copy(std::span<const T> src, std::span<T> dst) {
    KILN_CHECK(dst.size() >= src.size(), "copy of {} into {}", src.size(), dst.size());
    copy_bytes(std::as_bytes(src), std::as_writable_bytes(dst.first(src.size())));
  }
  // Columns [src_col, src_col + width) of `rows` rows of src (rows of src_w elements) into
  // columns [dst_col, ...) of dst (rows of dst_w): one copy_bytes_2d, bounds checked here.
  template <typename T>
  void copy_2d(std::span<const T> src, int64_t src_w, int64_t src_col, std::span<T> dst,
               int64_t dst_w, int64_t dst_col, int64_t rows, int64_t width) {
    if (rows <= 0 || width <= 0) return;
    KILN_CHECK(src_col >= 0 && dst_col >= 0 && src_col + width <= src_w &&
                   dst_col + width <= dst_w &&
                   static_cast<size_t>((rows - 1) * src_w + src_col + width) <= src.size() &&
                   static_cast<size_t>((rows - 1) * dst_w + dst_col + width) <= dst.size(),
               "copy_2d of {} x {} (rows of {} from column {}, {} values; into rows of {} from "
               "column {}, {} values) out of bounds",
               rows, width, src_w, src_col, src.size(), dst_w, dst_col, dst.size());
    copy_bytes_2d(reinterpret_cast<const std::byte*>(src.data() + src_col),
                  static_cast<size_t>(src_w) * sizeof(T),
                  reinterpret_cast<std::byte*>(dst.data() + dst_col),
                  static_cast<size_t>(dst_w) * sizeof(T), static_cast<size_t>(width) * sizeof(T),
                  static_cast<size_t>(rows));
  }
  // dst row i = src row ids[i]; rows of `width`, every id a row of src (gather_rows_f32).
  void gather_rows(std::span<const float> src, int64_t width, std::span<const int32_t> ids,
                   std::span<float> dst) {
    check_row_ids(src.size(), width, ids, dst.size(), "gather_rows");
    if (!ids.empty()) gather_rows_f32(src, width, ids, dst);
  }
  // out row ids[i] += (src row i *= scales[i]) for each i in order; the ids distinct rows of
  // out (scale_add_rows_f32).
  void scale_add_rows(std::span<float> src, int64_t width, std::span<const int32_t> ids,
                      std::span<const float> scales, std::span<float> out) {
    check_row_ids(out.size(), width, ids, src.size(), "scale_add_rows");
    KILN_CHECK(scales.size() == ids.size(), "scale_add_rows: {} scales for {} rows", scales.size(),
               ids.size());
    std::vector<bool> seen(out.size() / static_cast<size_t>(width));
    for (int32_t id : ids) {
      KILN_CHECK(!seen[static_cast<size_t>(id)], "scale_add_rows: row {} named twice", id);
      seen[static_cast<size_t>(id)] = true;
    }
    if (!ids.empty()) scale_add_rows_f32(src, width, ids, scales, out);
  }
  template <typename T>
  void zero(std::span<T> dst) {
    zero_bytes(std::as_writable_bytes(dst));
  }

  // y[t][r] = sum_c W[r][c] * x[t][c].   x: [n_tok][w.n_cols], y: [n_tok][w.n_rows]
  virtual void matmul(const WeightMatrix& w, std::span<const float> x, int64_t n_tok,
                      std::span<float> y) = 0;
  // Several independent matmuls of n_tok rows as one op (the selected experts of a MoE
  // decode step: many small matrices, where one pass over all their rows beats a thread
  // hand-off per matrix). Each y is bit-identical to matmul() of that task alone; tasks may
  // share an x but no y may overlap another task's x or y. Default: one matmul per task.
  struct MatmulTask {
    const WeightMatrix* w = nullptr;
    std::span<const float> x;  // [n_tok][w->n_cols]
    std::span<float> y;        // [n_tok][w->n_rows]
  };
  virtual void matmul_batch(std::span<const MatmulTask> tasks, int64_t n_tok) {
    for (const MatmulTask& t : tasks) matmul(*t.w, t.x, n_tok, t.y);
  }
  // out[i][:] = dequantized row ids[i] of w (embedding lookup).  out: [ids.size()][w.n_cols]
  virtual void get_rows(const WeightMatrix& w, std::span<const int32_t> ids,
                        std::span<float> out) = 0;
  // Per row of n: y = x / sqrt(mean(x^2) + eps) * weight  (weight empty: no scaling).
  virtual void rmsnorm(std::span<const float> x, std::span<const float> weight, int64_t n,
                       float eps, std::span<float> y) = 0;
  // x += a, then y = rmsnorm(x) per row of n: the residual add that ends a block and the norm
  // that starts the next one. Bits as add(x, a, x) followed by rmsnorm(x, weight, n, eps, y);
  // device backends override it to make one kernel of the two (a decode step is launch-bound
  // on such small ops).
  virtual void add_rmsnorm(std::span<float> x, std::span<const float> a,
                           std::span<const float> weight, int64_t n, float eps,
                           std::span<float> y) {
    add(x, a, x);
    rmsnorm(x, weight, n, eps, y);
  }
  // A hint: the matmuls that come next (over n_tok tokens) read these weights, in this order.
  // A device backend may start pulling their leading bytes into its cache now, while the ops
  // recorded before those matmuls run; no result may change. Null entries and matrices of no
  // rows are skipped. Default: nothing.
  virtual void prefetch_weights(std::span<const WeightMatrix* const> ws, int64_t n_tok) {
    (void)ws;
    (void)n_tok;
  }
  // In place on x: [n_tok][n_head][head_dim]; token t rotates by pos[t].
  virtual void rope(std::span<float> x, int64_t n_tok, int64_t n_head, int64_t head_dim,
                    std::span<const int32_t> pos, const RopeParams& p) = 0;
  // A layer's Q ([n_tok][n_head_q][head_dim]) and K ([n_tok][n_head_k][head_dim]) by the same
  // angles: the results of rope(q) then rope(k); a backend may run them as one op.
  virtual void rope_qk(std::span<float> q, int64_t n_head_q, std::span<float> k, int64_t n_head_k,
                       int64_t n_tok, int64_t head_dim, std::span<const int32_t> pos,
                       const RopeParams& p) {
    rope(q, n_tok, n_head_q, head_dim, pos, p);
    rope(k, n_tok, n_head_k, head_dim, pos, p);
  }
  // In place, per row of n.
  virtual void softmax(std::span<float> x, int64_t n) = 0;
  // out = silu(gate) * up  (SwiGLU), out = gelu_tanh(gate) * up (GeGLU, ggml's tanh form).
  virtual void swiglu(std::span<const float> gate, std::span<const float> up,
                      std::span<float> out) = 0;
  // y = w . swiglu(gate, up) over n_tok tokens: the results of swiglu(gate, up, act) then
  // matmul(w, act, n_tok, y). act is scratch: a backend that fuses the two may leave it
  // unwritten.
  virtual void swiglu_matmul(const WeightMatrix& w, std::span<const float> gate,
                             std::span<const float> up, int64_t n_tok, std::span<float> act,
                             std::span<float> y) {
    swiglu(gate, up, act);
    matmul(w, act, n_tok, y);
  }
  virtual void geglu(std::span<const float> gate, std::span<const float> up,
                     std::span<float> out) = 0;
  // gpt-oss's clamped SwiGLU, llama.cpp's swiglu_oai: with x = min(gate, limit) and
  // y = clamp(up, -limit, limit), out = x / (1 + exp(-alpha * x)) * (y + 1).
  virtual void swiglu_oai(std::span<const float> gate, std::span<const float> up,
                          std::span<float> out, float alpha, float limit) = 0;
  // Elementwise; `out` may alias an input.
  virtual void add(std::span<const float> a, std::span<const float> b, std::span<float> out) = 0;
  virtual void mul(std::span<const float> a, std::span<const float> b, std::span<float> out) = 0;
  // x *= s
  virtual void scale(std::span<float> x, float s) = 0;
  // x = cap * tanh(x / cap)
  virtual void softcap(std::span<float> x, float cap) = 0;
  // x = sigmoid(x)
  virtual void sigmoid(std::span<float> x) = 0;
  // f32 rows -> f16 plane rows: plane[rows[i]][:] = f16(src[i][:]).  src: [rows.size()][width]
  virtual void store_rows_f16(std::span<const float> src, int64_t width,
                              std::span<const int32_t> rows, std::span<f16> plane) = 0;
  virtual void attention(const AttentionArgs& a) = 0;
  // Several sequences' attention (a batched decode step: each sequence's queries over its own
  // planes) as one op; each out is bit-identical to attention() of that sequence alone.
  // Default: one attention() per sequence.
  virtual void attention_batch(std::span<const AttentionArgs> seqs) {
    for (const AttentionArgs& a : seqs) attention(a);
  }
  // Several store_rows_f16 scatters (each sequence's new K or V rows into its own plane) as
  // one op; no plane may be another task's. Default: one store_rows_f16() per task.
  struct StoreRowsTask {
    std::span<const float> src;
    int64_t width = 0;
    std::span<const int32_t> rows;
    std::span<f16> plane;
  };
  virtual void store_rows_f16_batch(std::span<const StoreRowsTask> tasks) {
    for (const StoreRowsTask& t : tasks) store_rows_f16(t.src, t.width, t.rows, t.plane);
  }
  // Index of the largest value (first on ties).
  virtual int64_t argmax(std::span<const float> x) = 0;
  // The k largest values of each of the rows of x ([rows][n], backend memory) in sampling order
  // (sampling/sampler.h): descending value, ascending index on ties; into host arrays
  // ids/vals [rows][k]. 1 <= k <= n. Waits for the ops before it, like download (a device
  // backend ships k values per row instead of n). NaN values: unspecified order. The default
  // works on host memory (a partial sort per row); a device backend overrides it. Inline, like
  // every other default here: an out-of-line virtual would become Backend's key function and
  // pin its typeinfo to one library that sanitizer builds of the others do not link.
  virtual void top_k(std::span<const float> x, int64_t n, int32_t k, std::span<int32_t> ids,
                     std::span<float> vals) {
    const size_t rows = top_k_rows(x, n, k, ids, vals), kk = static_cast<size_t>(k);
    std::vector<int32_t> idx(static_cast<size_t>(n));
    for (size_t r = 0; r < rows; ++r) {
      const float* row = x.data() + r * static_cast<size_t>(n);
      std::iota(idx.begin(), idx.end(), 0);
      std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [row](int32_t a, int32_t b) {
        return row[a] != row[b] ? row[a] > row[b] : a < b;
      });
      for (size_t j = 0; j < kk; ++j) {
        ids[r * kk + j] = idx[j];
        vals[r * kk + j] = row[idx[j]];
      }
    }
  }
  // The most candidates per row worth asking top_k for: the CUDA kernel's limit (beyond it the
  // backend downloads the rows anyway, and a sampler may as well take them whole).
  static constexpr int32_t kTopKMost = 256;
  // top_k's argument rules, checked; the number of rows.
  static size_t top_k_rows(std::span<const float> x, int64_t n, int32_t k,
                           std::span<const int32_t> ids, std::span<const float> vals) {
    KILN_CHECK(n > 0 && k >= 1 && k <= n && x.size() % static_cast<size_t>(n) == 0,
               "top_k: k {} of rows of {} ({} values)", k, n, x.size());
    const size_t rows = x.size() / static_cast<size_t>(n);
    KILN_CHECK(ids.size() == rows * static_cast<size_t>(k) && vals.size() == ids.size(),
               "top_k: {} ids and {} values for {} rows of {}", ids.size(), vals.size(), rows, k);
    return rows;
  }

  // gather_rows / scale_add_rows argument rules: `ids` name rows of `width` of a tensor of
  // `table` values, and `rows` values hold one row per id.
  static void check_row_ids(size_t table, int64_t width, std::span<const int32_t> ids, size_t rows,
                            const char* op) {
    KILN_CHECK(width > 0 && table % static_cast<size_t>(width) == 0 &&
                   rows == ids.size() * static_cast<size_t>(width),
               "{}: {} rows of {} against {} values, rows of {} from {} values", op, ids.size(),
               width, rows, width, table);
    const auto n = static_cast<int64_t>(table / static_cast<size_t>(width));
    for (int32_t id : ids) KILN_CHECK(id >= 0 && id < n, "{}: row {} of {}", op, id, n);
  }

  // --- Tensor parallelism (model/tensor_parallel.h). A group backend (backend/tp_group.h)
  // stands for tp_size() rank backends that run each forward step together, every rank over
  // its shard of the weights and KV heads; its own ops run on rank 0. A plain backend is a
  // group of one: itself.
  virtual int tp_size() const { return 1; }
  virtual Backend& tp_rank(int r) {
    KILN_CHECK(r == 0, "rank {} of a single backend", r);
    return *this;
  }
  // Runs f(r) for every rank r at once (rank 0 on the calling thread) and returns when all
  // have returned. Each rank's f must issue the same sequence of all_reduce_sum calls.
  virtual void tp_run(const std::function<void(int rank)>& f) { f(0); }
  // On a rank of a group: x = the sum of x over all ranks (the output of a row-parallel
  // matmul), ordered with the ops around it. Alone: x is unchanged.
  virtual void all_reduce_sum(std::span<float> x) { (void)x; }
};

// The scalar reference backend: every op in plain loops, the oracle for the others.
std::unique_ptr<Backend> make_ref_backend();

}  // namespace kiln
