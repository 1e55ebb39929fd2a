// tests/cuda/cuda_attention_test.cpp: CUDA attention against the reference on ring-shaped KV
// planes (physical rows out of logical order), GQA ratios 1/2/4/8, head sizes 64..256 and the
// latent attention rows of 576 (one KV head, V the K plane),
// decode (1 query, long contexts that split the keys over many blocks) and prefill (many
// queries), sliding windows, softcaps, and queries that see no key at all. Prefill shapes
// (32+ queries, head_dim 64/128) take the tensor-core tile kernel, held to a bound derived
// from its f16 roundings of Q and P.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>

#include "backend/cuda/kernels.h"
#include "core/half.h"
#include "cuda_test_common.h"
#include "ops/attention_common.h"
#include "ops/ops_common.h"

namespace kiln {
namespace {

using kiln::testing::AttnProblem;
using kiln::testing::close;
using kiln::testing::cuda_under_test;
using kiln::testing::ops_seed;
using kiln::testing::random_attention;
using kiln::testing::random_vec;

// The backend under test with CudaOptions::attention_warp_tiles = warp_tiles (the decode
// path's warp-tile kernel, or the split kernel): the shared one or its twin with the other.
CudaBackend& attention_backend(bool warp_tiles) {
  kiln::testing::CudaUnderTest& u = cuda_under_test();
  return warp_tiles == CudaOptions{}.attention_warp_tiles ? *u.cuda : *u.cuda_alt_attention;
}

struct AttnCase {
  int64_t n_head, n_head_kv, head_dim, n_q, n_kv;
  int32_t window;
  float softcap;
};

void run_case(CudaBackend& be, const AttnCase& c, std::mt19937_64& rng) {
  SCOPED_TRACE(::testing::Message()
               << "heads " << c.n_head << "/" << c.n_head_kv << " hd " << c.head_dim << " n_q "
               << c.n_q << " n_kv " << c.n_kv << " window " << c.window << " softcap " << c.softcap
               << " seed " << ops_seed());
  const int64_t q_w = c.n_head * c.head_dim;
  // A ring of n_kv + 3 rows; with more than two queries the first sees no key.
  AttnProblem p = random_attention(rng, c.n_head, c.n_head_kv, c.head_dim, c.n_q, c.n_kv,
                                   c.n_kv + 3, c.window, c.softcap, 2.0f, 3);
  const std::vector<float>& q = p.q;
  const std::vector<f16>&k = p.k, &v = p.v;
  std::vector<float> out_ref(q.size(), NAN), out_gpu(q.size(), NAN);
  AttentionArgs& a = p.args;
  a.out = out_ref;
  cuda_under_test().ref->attention(a);
  a.out = out_gpu;
  be.attention(a);
  cuda::DeviceAttention shape;
  shape.n_q = c.n_q, shape.n_kv = c.n_kv, shape.n_head = c.n_head, shape.n_head_kv = c.n_head_kv;
  shape.head_dim = c.head_dim;
  const bool tiles = cuda::attention_uses_tiles(shape);
  float kmax = 0, vmax = 0;
  for (size_t i = 0; i < k.size(); ++i) {
    kmax = std::max(kmax, std::fabs(f16_to_f32(k[i])));
    vmax = std::max(vmax, std::fabs(f16_to_f32(v[i])));
  }
  // Outputs are convex combinations of V rows (|v| <= ~5): f32 online softmax (expf, merged
  // splits) vs double. The tile kernel rounds Q to f16 (each logit off by at most
  // 2^-11 * scale * sum|q| * max|k|, which moves a softmax-weighted mean of V by at most twice
  // that times max|v|) and P to f16 (2^-11 relative per weight, in numerator and sum).
  for (size_t i = 0; i < q.size(); ++i) {
    double tol = 2e-5 * (1 + std::fabs(out_ref[i]));
    if (tiles) {
      const size_t row = i / size_t(c.head_dim);
      double qsum = 0;
      for (int64_t d = 0; d < c.head_dim; ++d) qsum += std::fabs(q[row * c.head_dim + d]);
      const double dlogit = std::ldexp(1.0, -11) * a.scale * qsum * kmax;
      tol += 2.0 * dlogit * vmax + std::ldexp(1.0, -10) * vmax;
    }
    ASSERT_TRUE(close(out_gpu[i], out_ref[i], tol)) << "elem " << i << (tiles ? " (tiles)" : "");
  }
  if (c.n_q > 2) {  // the query before every key: zeros
    for (int64_t d = 0; d < q_w; ++d) ASSERT_EQ(out_gpu[d], 0.0f);
  }
}

void run_configurations(bool warp_tiles) {
  CudaBackend& be = attention_backend(warp_tiles);
  std::mt19937_64 rng(ops_seed());
  const AttnCase cases[] = {
      {1, 1, 64, 1, 1, 0, 0},
      {4, 4, 64, 1, 37, 0, 0},
      {8, 2, 64, 1, 129, 0, 0},
      {8, 1, 128, 1, 3000, 0, 0},
      {32, 8, 128, 1, 4097, 0, 0},
      {8, 2, 80, 7, 50, 0, 0},
      {4, 4, 96, 33, 33, 0, 0},
      {16, 4, 128, 70, 300, 0, 0},
      {8, 4, 256, 5, 200, 0, 0},
      {4, 2, 64, 9, 200, 16, 0},
      {4, 2, 64, 1, 2000, 100, 0},
      {8, 2, 128, 6, 300, 0, 30.0f},
      {8, 8, 256, 17, 700, 64, 50.0f},
      {2, 1, 48, 3, 10, 0, 0},
      {8, 8, 32, 1, 70000, 0, 0},
      // The tile kernel: GQA groups 1/2/4/8, causal prefill from an empty cache, a suffix of a
      // longer context, windows, softcap, key counts off the 64-key tile.
      {32, 8, 128, 512, 512, 0, 0},
      {8, 8, 128, 33, 33, 0, 0},
      {8, 1, 64, 100, 1000, 0, 0},
      {4, 2, 64, 40, 77, 16, 0},
      {8, 2, 128, 64, 130, 0, 30.0f},
      {16, 4, 64, 257, 300, 100, 0},
      // Warp tiles: one slice (<= 256 keys, written without a merge), several, key counts off
      // the 32-key tile and the 128-key warp round, GQA 1-8, heads 32-256.
      {32, 8, 128, 1, 256, 0, 0},
      {32, 8, 128, 1, 257, 0, 0},
      {32, 8, 128, 2, 1000, 0, 0},
      {8, 1, 64, 1, 95, 0, 0},
      {16, 16, 256, 1, 600, 0, 0},
      {8, 4, 160, 3, 333, 40, 0},
  };
  for (const AttnCase& c : cases) run_case(be, c, rng);
}

TEST(CudaAttention, Configurations) {
  KILN_REQUIRE_CUDA();
  run_configurations(false);
  cuda::DeviceAttention prefill;  // the 8B shape's prefill chunk takes the tile kernel
  prefill.n_q = 512, prefill.n_kv = 512, prefill.n_head = 32, prefill.n_head_kv = 8;
  prefill.head_dim = 128;
  EXPECT_TRUE(cuda::attention_uses_tiles(prefill));
}

// The same cases with the warp-tile decode kernel (the prefill shapes still take the tile
// kernel): the same f32 bound of the reference as the split kernel.
TEST(CudaAttention, WarpTilesConfigurations) {
  KILN_REQUIRE_CUDA();
  EXPECT_TRUE(cuda::attention_warp_tiles_fit(128, reinterpret_cast<void*>(256),
                                             reinterpret_cast<void*>(512)));
  EXPECT_FALSE(cuda::attention_warp_tiles_fit(100, reinterpret_cast<void*>(256),
                                              reinterpret_cast<void*>(512)));
  EXPECT_FALSE(cuda::attention_warp_tiles_fit(128, reinterpret_cast<void*>(258),
                                              reinterpret_cast<void*>(512)));
  run_configurations(true);
}

// The first physical row of n_phys that no key of p uses (a row to poison).
int32_t unused_row(const AttnProblem& p, int64_t n_phys) {
  std::vector<bool> used(size_t(n_phys), false);
  for (int32_t r : p.kv_rows) used[size_t(r)] = true;
  return int32_t(std::find(used.begin(), used.end(), false) - used.begin());
}

// p's key list padded to whole 256-key buckets as graph mode pads it, the padding at `row`.
void pad_keys(AttnProblem& p, int32_t row) {
  const auto padded = size_t((int64_t(p.kv_rows.size()) + 255) / 256 * 256);
  p.kv_rows.resize(padded, row);
  p.kv_pos.resize(padded, INT32_MAX);
  p.args.kv_rows = p.kv_rows;
  p.args.kv_pos = p.kv_pos;
}

// p's args on the reference and on be: every reference value finite, be's within the f32 bound
// of the reference; be's output in *got.
void expect_near_reference(CudaBackend& be, AttnProblem& p, std::vector<float>* got) {
  std::vector<float> want(p.q.size(), NAN);
  got->assign(p.q.size(), NAN);
  p.args.out = want;
  cuda_under_test().ref->attention(p.args);
  p.args.out = *got;
  be.attention(p.args);
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_TRUE(std::isfinite(want[i])) << i;
    ASSERT_TRUE(close((*got)[i], want[i], 2e-5 * (1 + std::fabs(want[i])))) << "elem " << i;
  }
}

// A decode key list padded as graph mode pads it, whose padding and some out-of-window keys
// point at a row holding inf and NaN in K and V that no visible key uses: neither kernel lets it
// reach the output (the warp-tile kernel reads a visible key's rows for them; the split kernel
// skips them), and both stay within the f32 bound of the reference.
TEST(CudaAttention, InvisibleRowsNeverReachTheOutput) {
  KILN_REQUIRE_CUDA();
  std::mt19937_64 rng(ops_seed());
  for (const bool wt : {false, true}) {
    CudaBackend& be = attention_backend(wt);
    for (const int64_t n_kv : {int64_t{70}, int64_t{300}}) {
      SCOPED_TRACE(::testing::Message()
                   << "warp tiles " << wt << " n_kv " << n_kv << " seed " << ops_seed());
      const int64_t n_head = 32, n_head_kv = 8, hd = 128, kv_w = n_head_kv * hd;
      AttnProblem p = random_attention(rng, n_head, n_head_kv, hd, 1, n_kv, n_kv + 3,
                                       /*window=*/50, 0.0f, 2.0f, 3);
      // A ring row no key uses: poisoned, and what every padding key and a third of the keys
      // before the window point at.
      const int32_t poison = unused_row(p, n_kv + 3);
      ASSERT_LT(poison, n_kv + 3);
      for (int64_t j = 0; j + 50 < n_kv; j += 3) p.kv_rows[size_t(j)] = poison;
      for (int64_t d = 0; d < kv_w; ++d) {
        p.k[size_t(poison * kv_w + d)] = f32_to_f16(d % 2 ? INFINITY : NAN);
        p.v[size_t(poison * kv_w + d)] = f32_to_f16(d % 2 ? NAN : -INFINITY);
      }
      pad_keys(p, poison);
      p.args.k = p.k;
      p.args.v = p.v;
      std::vector<float> got;
      ASSERT_NO_FATAL_FAILURE(expect_near_reference(be, p, &got));
    }
  }
}

// A batched decode step's attention (Backend::attention_batch on device memory: one launch
// for the sequences that take the split kernel, one attention() each for the rest): every
// sequence's output has exactly the bits of attention() of that sequence alone, and is within
// the f32 bound of the reference. Sequences of different lengths (splits from 1 to many), 1-3
// queries, rings, a window and a softcap, plus one prefill-sized sequence (the tile kernel)
// in the same batch; and latent attention's 576-wide rows with V the K plane (the wide kernel,
// its 40-query sequence batched with the rest). store_rows_f16_batch likewise against
// store_rows_f16.
// A decode key list padded as graph mode pads it (invisible keys at row 0, position INT32_MAX,
// up to the bucket): the split kernel's slices holding only padding write their empty partials
// at once (the walk they replaced gave the same bits: CUDA session 15's same-bits test); the
// result must be the reference's. GQA groups 1-8, head sizes 64 (P 1), 128 (P 2) and 256 (P 4),
// a window and a softcap.
TEST(CudaAttention, PaddedKeyListsMatchTheReference) {
  KILN_REQUIRE_CUDA();
  CudaBackend& be = attention_backend(false);  // the split kernel
  std::mt19937_64 rng(ops_seed());
  struct Shape {
    int64_t n_head, n_head_kv, hd, n_kv;
    int32_t window;
    float softcap;
  };
  for (const Shape c : {Shape{32, 8, 128, 70, 0, 0.0f}, Shape{8, 8, 64, 300, 0, 0.0f},
                        Shape{16, 2, 256, 33, 20, 30.0f}, Shape{8, 4, 96, 129, 0, 0.0f}}) {
    SCOPED_TRACE(::testing::Message() << "heads " << c.n_head << "/" << c.n_head_kv << " hd "
                                      << c.hd << " n_kv " << c.n_kv << " seed " << ops_seed());
    AttnProblem p = random_attention(rng, c.n_head, c.n_head_kv, c.hd, 1, c.n_kv, c.n_kv + 3,
                                     c.window, c.softcap, 2.0f, 3);
    const int64_t padded = (c.n_kv + 255) / 256 * 256 + 256;
    p.kv_rows.resize(size_t(padded), 0);
    p.kv_pos.resize(size_t(padded), INT32_MAX);
    p.args.kv_rows = p.kv_rows;
    p.args.kv_pos = p.kv_pos;
    std::vector<float> skip(p.q.size(), NAN), want(p.q.size(), NAN);
    p.args.out = want;
    cuda_under_test().ref->attention(p.args);
    p.args.out = skip;
    be.attention(p.args);
    for (size_t i = 0; i < want.size(); ++i)
      ASSERT_NEAR(skip[i], want[i], 1e-3f * (1.0f + std::fabs(want[i]))) << i;
  }
}

// Heads of an attention call; v_is_k: latent attention (V is the K plane, the wide kernel at 576).
struct HeadShape {
  int64_t n_head, n_head_kv, hd;
  int32_t window;
  float softcap;
  bool v_is_k = false;
};
// The call for n_q queries of one sequence over the listed keys, with sh's heads.
AttentionArgs head_shape_args(const HeadShape& sh, std::span<const float> q, std::span<const f16> k,
                              std::span<const f16> v, std::span<const int32_t> rows,
                              std::span<const int32_t> pos, std::span<const int32_t> q_pos,
                              int64_t n_q, std::span<float> out) {
  AttentionArgs a;
  a.q = q;
  a.k = k;
  a.v = sh.v_is_k ? k : v;
  a.kv_rows = rows;
  a.kv_pos = pos;
  a.q_pos = q_pos;
  a.n_q = n_q;
  a.n_head = sh.n_head;
  a.n_head_kv = sh.n_head_kv;
  a.head_dim = sh.hd;
  a.window = sh.window;
  a.scale = 1.0f / std::sqrt(float(sh.hd));
  a.softcap = sh.softcap;
  a.out = out;
  return a;
}

void run_batch_of_sequences(bool warp_tiles) {
  CudaBackend& be = attention_backend(warp_tiles);
  Backend& ref = *cuda_under_test().ref;
  std::mt19937_64 rng(ops_seed());
  using Shape = HeadShape;
  struct Seq {
    int64_t n_q, n_kv;
  };
  const Seq seqs[] = {{1, 1}, {1, 37}, {2, 300}, {1, 4097}, {3, 64}, {1, 1000}, {40, 90}};
  for (const Shape sh :
       {Shape{32, 8, 128, 0, 0.0f}, Shape{4, 4, 64, 50, 30.0f}, Shape{16, 1, 576, 0, 0.0f, true}}) {
    SCOPED_TRACE(::testing::Message() << "heads " << sh.n_head << "/" << sh.n_head_kv << " hd "
                                      << sh.hd << " seed " << ops_seed());
    const int64_t q_w = sh.n_head * sh.hd, kv_w = sh.n_head_kv * sh.hd;
    struct Host {
      std::vector<float> q, src_k;
      std::vector<f16> k, v;
      std::vector<int32_t> rows, pos, q_pos, new_rows;
      BackendBuffer<float> dq, out_batch, out_solo, dsrc;
      BackendBuffer<f16> dk, dv, store_a, store_b;
    };
    std::vector<Host> hs(std::size(seqs));
    std::vector<AttentionArgs> args;
    std::vector<Backend::StoreRowsTask> stores_a, stores_b;
    for (size_t i = 0; i < std::size(seqs); ++i) {
      const Seq& c = seqs[i];
      Host& h = hs[i];
      const int64_t n_phys = c.n_kv + 5;
      const auto origin = static_cast<int32_t>(rng() % n_phys);
      for (int64_t j = 0; j < c.n_kv; ++j) {
        h.rows.push_back(static_cast<int32_t>((j + origin) % n_phys));
        h.pos.push_back(static_cast<int32_t>(j));
      }
      for (int64_t t = 0; t < c.n_q; ++t)
        h.q_pos.push_back(static_cast<int32_t>(c.n_kv - c.n_q + t));
      const std::vector<float> kf = random_vec(rng, n_phys * kv_w),
                               vf = random_vec(rng, n_phys * kv_w);
      for (size_t e = 0; e < kf.size(); ++e) {
        h.k.push_back(f32_to_f16(kf[e]));
        h.v.push_back(f32_to_f16(vf[e]));
      }
      h.q = random_vec(rng, c.n_q * q_w, 2.0f);
      h.dq = be.alloc<float>(h.q.size());
      h.out_batch = be.alloc<float>(h.q.size());
      h.out_solo = be.alloc<float>(h.q.size());
      h.dk = be.alloc<f16>(h.k.size());
      h.dv = be.alloc<f16>(h.v.size());
      be.upload<float>(h.q, h.dq.span());
      be.upload<f16>(h.k, h.dk.span());
      be.upload<f16>(h.v, h.dv.span());
      args.push_back(head_shape_args(sh, h.dq.span(), h.dk.span(), h.dv.span(), h.rows, h.pos,
                                     h.q_pos, c.n_q, h.out_batch.span()));
      // Stores: c.n_q new rows at ring rows of this sequence's own planes.
      h.src_k = random_vec(rng, c.n_q * kv_w);
      h.dsrc = be.alloc<float>(h.src_k.size());
      be.upload<float>(h.src_k, h.dsrc.span());
      for (int64_t t = 0; t < c.n_q; ++t) h.new_rows.push_back(h.rows[size_t(c.n_kv - c.n_q + t)]);
      h.store_a = be.alloc<f16>(h.k.size());
      h.store_b = be.alloc<f16>(h.k.size());
      stores_a.push_back({h.dsrc.span(), kv_w, h.new_rows, h.store_a.span()});
      stores_b.push_back({h.dsrc.span(), kv_w, h.new_rows, h.store_b.span()});
    }
    be.attention_batch(args);
    be.store_rows_f16_batch(stores_a);
    for (size_t i = 0; i < args.size(); ++i) {
      AttentionArgs a = args[i];
      a.out = hs[i].out_solo.span();
      be.attention(a);
      be.store_rows_f16(stores_b[i].src, stores_b[i].width, stores_b[i].rows, stores_b[i].plane);
    }
    for (size_t i = 0; i < args.size(); ++i) {
      Host& h = hs[i];
      std::vector<float> got(h.q.size(), NAN), solo(h.q.size(), 0.0f), want(h.q.size(), NAN);
      be.download<float>(h.out_batch.span(), got);
      be.download<float>(h.out_solo.span(), solo);
      EXPECT_EQ(std::memcmp(got.data(), solo.data(), got.size() * sizeof(float)), 0)
          << "sequence " << i << " (n_kv " << seqs[i].n_kv << ")";
      AttentionArgs a = args[i];
      a.q = h.q;
      a.k = h.k;
      a.v = sh.v_is_k ? h.k : h.v;
      a.out = want;
      ref.attention(a);
      cuda::DeviceAttention shape;
      shape.n_q = a.n_q, shape.n_kv = seqs[i].n_kv, shape.n_head = a.n_head;
      shape.n_head_kv = a.n_head_kv, shape.head_dim = a.head_dim;
      const double loose = cuda::attention_uses_tiles(shape) ? 0.05 : 0.0;  // f16 Q and P
      for (size_t e = 0; e < got.size(); ++e)
        ASSERT_TRUE(close(got[e], want[e], 2e-5 * (1 + std::fabs(want[e])) + loose))
            << "sequence " << i << " elem " << e;
      std::vector<f16> pa(h.k.size()), pb(h.k.size());
      be.download<f16>(h.store_a.span(), pa);
      be.download<f16>(h.store_b.span(), pb);
      EXPECT_EQ(std::memcmp(pa.data(), pb.data(), pa.size() * sizeof(f16)), 0) << "store " << i;
      int64_t nonzero = 0;
      for (f16 x : pa) nonzero += x.bits != 0;
      EXPECT_GT(nonzero, 0) << "store " << i << " wrote nothing";
    }
  }
}

TEST(CudaAttention, BatchOfSequencesHasEachSequencesBits) {
  KILN_REQUIRE_CUDA();
  run_batch_of_sequences(false);
}

TEST(CudaAttention, WarpTilesBatchOfSequencesHasEachSequencesBits) {
  KILN_REQUIRE_CUDA();
  run_batch_of_sequences(true);
}

// A short run of queries of one sequence (a speculative verify batch: 2..16 queries) gives each
// query the bits of a one-query call over the keys it sees (the decode step at its position),
// on device buffers with the key list in ring order; warp tiles on and off, a window with a
// softcap, and latent rows (V the K plane). What greedy speculative decoding needs for plain
// greedy's ids on CUDA (docs/determinism.md).
TEST(CudaAttention, ShortQueryRunsHaveTheOneQueryBits) {
  KILN_REQUIRE_CUDA();
  std::mt19937_64 rng(ops_seed());
  using Shape = HeadShape;
  for (const bool wt : {false, true}) {
    CudaBackend& be = attention_backend(wt);
    for (const Shape sh : {Shape{32, 8, 128, 0, 0.0f, false}, Shape{4, 4, 64, 50, 30.0f, false},
                           Shape{16, 1, 576, 0, 0.0f, true}}) {
      for (const int64_t n_q : {2, 5, 16}) {
        for (const int64_t n_kv : {int64_t{16}, int64_t{300}, int64_t{1000}}) {
          SCOPED_TRACE(::testing::Message() << "warp tiles " << wt << " heads " << sh.n_head << "/"
                                            << sh.n_head_kv << " hd " << sh.hd << " n_q " << n_q
                                            << " n_kv " << n_kv << " seed " << ops_seed());
          const int64_t q_w = sh.n_head * sh.hd, kv_w = sh.n_head_kv * sh.hd, n_phys = n_kv + 3;
          const auto origin = static_cast<int32_t>(rng() % n_phys);
          std::vector<int32_t> rows, pos, q_pos;
          for (int64_t j = 0; j < n_kv; ++j) {
            rows.push_back(static_cast<int32_t>((j + origin) % n_phys));
            pos.push_back(static_cast<int32_t>(j));
          }
          for (int64_t t = 0; t < n_q; ++t) q_pos.push_back(static_cast<int32_t>(n_kv - n_q + t));
          std::vector<f16> k, v;
          for (float x : random_vec(rng, n_phys * kv_w)) k.push_back(f32_to_f16(x));
          for (float x : random_vec(rng, n_phys * kv_w)) v.push_back(f32_to_f16(x));
          const std::vector<float> q = random_vec(rng, n_q * q_w, 2.0f);
          BackendBuffer<float> dq = be.alloc<float>(q.size()), d_run = be.alloc<float>(q.size());
          BackendBuffer<float> d_one = be.alloc<float>(q.size());
          BackendBuffer<f16> dk = be.alloc<f16>(k.size()), dv = be.alloc<f16>(v.size());
          be.upload<float>(q, dq.span());
          be.upload<f16>(k, dk.span());
          be.upload<f16>(v, dv.span());
          const AttentionArgs a = head_shape_args(sh, dq.span(), dk.span(), dv.span(), rows, pos,
                                                  q_pos, n_q, d_run.span());
          be.attention(a);
          for (int64_t t = 0; t < n_q; ++t) {
            const auto ts = static_cast<size_t>(t), w = static_cast<size_t>(q_w);
            const auto seen = static_cast<size_t>(n_kv - n_q + t + 1);
            AttentionArgs one = a;
            one.q = dq.span().subspan(ts * w, w);
            one.out = d_one.span().subspan(ts * w, w);
            one.q_pos = std::span<const int32_t>(q_pos).subspan(ts, 1);
            one.kv_rows = std::span<const int32_t>(rows).first(seen);
            one.kv_pos = std::span<const int32_t>(pos).first(seen);
            one.n_q = 1;
            be.attention(one);
          }
          std::vector<float> run(q.size(), NAN), one(q.size(), 0.0f), want(q.size(), NAN);
          be.download<float>(d_run.span(), run);
          be.download<float>(d_one.span(), one);
          ASSERT_EQ(std::memcmp(run.data(), one.data(), run.size() * sizeof(float)), 0);
          cuda_under_test().ref->attention(
              head_shape_args(sh, q, k, v, rows, pos, q_pos, n_q, want));
          for (size_t e = 0; e < run.size(); ++e)
            ASSERT_TRUE(close(run[e], want[e], 2e-5 * (1 + std::fabs(want[e])))) << "elem " << e;
        }
      }
    }
  }
}

// Latent attention as the deepseek2 forward pass runs it (model/forward.cpp mla_attention):
// MQA (one KV head) over rows of kv_lora + rope values, V the K plane itself. DeepSeek-V3 and
// Kimi-K2's rows are 576 wide (512 + 64), past the 256 of the split / warp-tile / tile kernels:
// the wide kernel serves them, decode and prefill alike, with either value of
// attention_warp_tiles. Groups of 4 (16 and 128 heads), 2 (6 heads) and 1 (3 heads), a
// 320-wide row (kv_lora 256: the wide kernel's pairs past the row skipped), one GQA case of
// two wide KV heads; decode at 1, 37, 1000 and 4097 keys (one slice, several, merged), prefill
// of 17 queries from an empty cache and as a suffix of 300 keys (the first query sees none).
// Decode key lists are padded as graph mode pads them, padding and keys out of a window
// pointing at a ring row of inf and NaN no visible key uses. The f32 bound of the reference.
TEST(CudaAttention, LatentRows576MatchTheReference) {
  KILN_REQUIRE_CUDA();
  EXPECT_TRUE(cuda::attention_warp_tiles_fit(576, reinterpret_cast<void*>(256),
                                             reinterpret_cast<void*>(512)));
  EXPECT_FALSE(cuda::attention_warp_tiles_fit(584, reinterpret_cast<void*>(256),
                                              reinterpret_cast<void*>(512)));
  std::mt19937_64 rng(ops_seed());
  const AttnCase cases[] = {
      {16, 1, 576, 1, 1, 0, 0},    {16, 1, 576, 1, 37, 0, 0},     {16, 1, 576, 1, 1000, 0, 0},
      {16, 1, 576, 1, 4097, 0, 0}, {128, 1, 576, 1, 1000, 0, 0},  {16, 1, 576, 17, 17, 0, 0},
      {16, 1, 576, 17, 300, 0, 0}, {128, 1, 576, 17, 300, 0, 0},  {6, 1, 576, 1, 700, 0, 0},
      {3, 1, 576, 5, 257, 0, 0},   {16, 1, 320, 1, 600, 0, 0},    {16, 1, 320, 9, 100, 0, 0},
      {8, 2, 576, 2, 333, 0, 0},   {16, 1, 576, 1, 2000, 300, 0}, {16, 1, 576, 4, 90, 0, 30.0f},
  };
  for (const bool wt : {false, true}) {
    CudaBackend& be = attention_backend(wt);
    for (const AttnCase& c : cases) {
      SCOPED_TRACE(::testing::Message()
                   << "warp tiles " << wt << " heads " << c.n_head << "/" << c.n_head_kv << " hd "
                   << c.head_dim << " n_q " << c.n_q << " n_kv " << c.n_kv << " window " << c.window
                   << " softcap " << c.softcap << " seed " << ops_seed());
      const int64_t kv_w = c.n_head_kv * c.head_dim;
      AttnProblem p = random_attention(rng, c.n_head, c.n_head_kv, c.head_dim, c.n_q, c.n_kv,
                                       c.n_kv + 3, c.window, c.softcap, 2.0f, 3);
      if (c.n_q == 1) {
        const int32_t poison = unused_row(p, c.n_kv + 3);
        ASSERT_LT(poison, c.n_kv + 3);
        for (int64_t d = 0; d < kv_w; ++d)
          p.k[size_t(poison * kv_w + d)] = f32_to_f16(d % 2 ? INFINITY : NAN);
        if (c.window > 0)
          for (int64_t j = 0; j + c.window < c.n_kv; j += 3) p.kv_rows[size_t(j)] = poison;
        pad_keys(p, poison);
      }
      p.args.k = p.k;
      p.args.v = p.k;  // V = K: the latent rows
      std::vector<float> got;
      ASSERT_NO_FATAL_FAILURE(expect_near_reference(be, p, &got));
      if (c.n_q > 2) {  // the query before every key: zeros
        for (int64_t d = 0; d < c.n_head * c.head_dim; ++d) ASSERT_EQ(got[size_t(d)], 0.0f);
      }
    }
  }
}

TEST(CudaAttention, NoKeysGivesZeros) {
  KILN_REQUIRE_CUDA();
  for (const bool wt : {false, true}) {
    std::vector<float> q(2 * 64, 1.0f), out(q.size(), NAN);
    std::vector<f16> k(64), v(64);
    AttentionArgs a;
    a.q = q;
    a.k = k;
    a.v = v;
    std::vector<int32_t> q_pos = {0, 5};
    a.q_pos = q_pos;
    a.n_q = 2;
    a.n_head = 1;
    a.n_head_kv = 1;
    a.head_dim = 64;
    a.out = out;
    attention_backend(wt).attention(a);  // n_kv = 0
    for (float x : out) ASSERT_EQ(x, 0.0f);
  }
}

}  // namespace
}  // namespace kiln
