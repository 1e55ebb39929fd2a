// model/tensor_parallel.cpp: shard_model (see tensor_parallel.h).
#include "model/tensor_parallel.h"

namespace kiln::model {
namespace {

// A row-parallel matrix's column block must hold whole quant blocks of every row.
Status check_columns(const WeightMatrix& m, int64_t per_rank, const char* what, int n) {
  const int64_t blk = traits(m.dtype).block_size;
  if (per_rank % blk != 0)
    return Status::errorf("{}'s {} columns per rank (of {}) are not whole {} blocks of {}", what,
                          per_rank, n, dtype_name(m.dtype), blk);
  return Status::ok();
}

std::span<const float> part(std::span<const float> v, int64_t per_rank, int rank) {
  if (v.empty()) return v;
  return v.subspan(static_cast<size_t>(per_rank * rank), static_cast<size_t>(per_rank));
}

}  // namespace

Expected<Shard> shard_model(const HParams& hp, const Weights& w, int rank, int n) {
  if (n < 1 || rank < 0 || rank >= n) return Status::errorf("rank {} of {} ranks", rank, n);
  Shard s{hp, w};
  s.w.owned.clear();  // the views point into the model's own copies
  if (n == 1) return s;
  // Latent attention splits its query heads; its one latent KV head is replicated: every rank
  // computes and caches the whole latent row and attends with its own heads.
  const int32_t n_head_kv = hp.is_mla() ? n : hp.n_head_kv;
  if (hp.n_head % n != 0 || n_head_kv % n != 0)
    return Status::errorf("{} query heads and {} KV heads do not split evenly over {} ranks",
                          hp.n_head, hp.n_head_kv, n);
  s.hp.tp_rank = rank;
  s.hp.tp_size = n;
  s.hp.n_head = hp.n_head / n;
  s.hp.n_head_kv = hp.is_mla() ? 1 : hp.n_head_kv / n;
  const int64_t qw = s.hp.q_width(), kw = s.hp.k_width(), vw = s.hp.v_width();
  const int64_t ow = hp.is_mla() ? int64_t(s.hp.n_head) * hp.mla.v : s.hp.o_width();
  for (size_t il = 0; il < hp.layers.size(); ++il) {
    LayerDesc& L = s.hp.layers[il];
    LayerWeights& lw = s.w.layers[il];
    const std::string blk = fmt::format("blk.{}", il);
    if (hp.is_mla()) {
      // This rank's heads of the query projection and of both decompressions.
      const int64_t nh = s.hp.n_head, qh = nh * hp.mla.q_head();
      WeightMatrix& wq = lw.wq_b.n_rows > 0 ? lw.wq_b : lw.wq;
      wq = wq.rows(qh * rank, qh);
      lw.wk_b = lw.wk_b.rows(nh * hp.mla.kv_lora * rank, nh * hp.mla.kv_lora);
      lw.wv_b = lw.wv_b.rows(nh * hp.mla.v * rank, nh * hp.mla.v);
    } else {
      lw.wq = lw.wq.rows(qw * rank, qw);
      lw.wk = lw.wk.rows(kw * rank, kw);
      lw.wv = lw.wv.rows(vw * rank, vw);
    }
    lw.bq = part(lw.bq, qw, rank);
    lw.bk = part(lw.bk, kw, rank);
    lw.bv = part(lw.bv, vw, rank);
    lw.attn_sinks = part(lw.attn_sinks, s.hp.n_head, rank);
    // The output projection's partial sums are added by the all-reduce: its bias once.
    if (rank != 0) lw.bo = {};
    if (lw.wgate_attn.n_rows > 0) lw.wgate_attn = lw.wgate_attn.rows(ow * rank, ow);
    KILN_TRY(check_columns(lw.wo, ow, (blk + ".attn_output").c_str(), n));
    lw.wo = lw.wo.columns(ow * rank, ow);
    if (L.n_expert == 0) {
      if (L.n_ff % n != 0)
        return Status::errorf("{}'s FFN width {} does not split evenly over {} ranks", blk, L.n_ff,
                              n);
      const int64_t f = L.n_ff / n;
      KILN_TRY(check_columns(lw.ffn_down, f, (blk + ".ffn_down").c_str(), n));
      lw.ffn_gate = lw.ffn_gate.rows(f * rank, f);
      lw.ffn_up = lw.ffn_up.rows(f * rank, f);
      lw.ffn_down = lw.ffn_down.columns(f * rank, f);
      L.n_ff = static_cast<int32_t>(f);
    } else if (L.n_expert < n) {
      return Status::errorf("{} has {} experts, fewer than the {} ranks", blk, L.n_expert, n);
    } else if (L.n_ff_shexp > 0) {
      // Shared experts split like a dense FFN: the all-reduce adds the ranks' shares to the
      // routed sum.
      if (L.n_ff_shexp % n != 0)
        return Status::errorf("{}'s shared-expert width {} does not split evenly over {} ranks",
                              blk, L.n_ff_shexp, n);
      const int64_t f = L.n_ff_shexp / n;
      KILN_TRY(check_columns(lw.ffn_down_shexp, f, (blk + ".ffn_down_shexp").c_str(), n));
      lw.ffn_gate_shexp = lw.ffn_gate_shexp.rows(f * rank, f);
      lw.ffn_up_shexp = lw.ffn_up_shexp.rows(f * rank, f);
      lw.ffn_down_shexp = lw.ffn_down_shexp.columns(f * rank, f);
      L.n_ff_shexp = static_cast<int32_t>(f);
    }
  }
  return s;
}

}  // namespace kiln::model
