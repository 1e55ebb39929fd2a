// model/forward.h: the fast forward pass: the reference graph built only from Backend ops.
// A prefill runs all of its tokens through each weight matrix in one matmul (matrix-matrix);
// a decode step is the same code with one row. KV storage belongs to the caller (the engine
// adapts kv/KvCache to LayerKv), so this layer does not depend on kv/.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "core/half.h"
#include "model/capture.h"
#include "model/hparams.h"
#include "model/weights.h"

namespace kiln::model {

// One layer's KV planes for the step being evaluated.
struct LayerKv {
  std::span<const int32_t> append_rows;  // [n_tok] physical rows the new keys/values go to
  std::span<const int32_t> kv_rows;      // physical row of every key the batch may see
  std::span<const int32_t> kv_pos;       // position of each of those keys
  std::span<f16> k, v;                   // planes [n_phys][k_width | v_width]; latent
                                         // attention: v empty (HParams::kv_v_width() is 0)
  // Sparse attention, full indexer layers (LayerDesc::indexer_kv): the indexer keys' plane
  // [n_phys][dsa.head_dim], rows as k's; empty elsewhere.
  std::span<f16> idx_k;
};

// One sequence's share of a multi-sequence batch (batched decode across slots): tokens
// [first, first + n_tok) of the batch belong to it and attend only over its own planes.
struct SeqSlice {
  int32_t first = 0, n_tok = 0;
  std::span<const LayerKv> kv;  // [n_layer]: this sequence's planes and row lists
  bool all_logits = false;      // logits of every token, not only the last (verification)
};

struct ForwardBatch {
  std::span<const int32_t> tokens;  // [n_tok], ids already validated
  std::span<const int32_t> pos;     // [n_tok]
  std::span<const LayerKv> kv;      // [n_layer]; unused when `seqs` is set
  // Empty: every token belongs to one sequence whose planes are `kv`. Otherwise the batch
  // holds several sequences, each a contiguous run of tokens, in order, covering the batch;
  // the weights are read once for all of them while attention stays per sequence, and the
  // logits hold, sequence by sequence, every token's row (its all_logits, or the batch's) or
  // its last token's.
  std::span<const SeqSlice> seqs;
  bool all_logits = false;     // false: logits of the last token (of each sequence) only
  Capture* capture = nullptr;  // optional: records the named activations
  // > 0: each output row's top_k best candidates in sampling order (Backend::top_k) go to
  // top_ids/top_vals [n_out][top_k], and a device backend downloads only those: `logits` is
  // then left unwritten there (unless capture records it); a host backend computes in it.
  int32_t top_k = 0;
  std::span<int32_t> top_ids;
  std::span<float> top_vals;
};

// Activation scratch for batches of up to max_batch tokens, reused across steps.
class ForwardState {
 public:
  ForwardState(const HParams& hp, int32_t max_batch);
  int32_t max_batch() const { return max_batch_; }

 private:
  friend class ForwardPass;  // forward.cpp: one call of forward()
  int32_t max_batch_;
  // Activation scratch lives in the memory of the backend that runs the step (device memory
  // on a GPU), allocated on the first forward() with that backend; the element counts are
  // fixed by the constructor.
  void bind(Backend& be);
  Backend* bound_ = nullptr;
  size_t n_x_ = 0, n_q_ = 0, n_k_ = 0, n_v_ = 0, n_o_ = 0, n_ff_ = 0, n_tmp_ = 0;
  size_t n_router_ = 0, n_moe_ = 0, n_logits_ = 0;
  BackendBuffer<float> x, h, q, k, v, o, gate, a, ff_gate, ff_up, ff_act, tmp;
  // Latent attention (HParams::mla), else empty: q-LoRA rows [B][q_lora], the per-head
  // queries [B][n_head][nope + rope], the latent projection [B][kv_lora + rope], the RoPE
  // parts [B][n_head][rope] and [B][rope], the normalised latent [B][kv_lora], per-head
  // gathered rows in and out of the attn_k_b / attn_v_b matmuls [n_head][B][max width], and
  // the heads' values [B][n_head][v].
  size_t n_mla_qa_ = 0, n_mla_q_ = 0, n_mla_kv_ = 0, n_mla_qpe_ = 0, n_mla_kpe_ = 0;
  size_t n_mla_c_ = 0, n_mla_heads_ = 0, n_mla_ov_ = 0;
  BackendBuffer<float> mla_qa, mla_q, mla_kv, mla_qpe, mla_kpe, mla_c, mla_in, mla_out, mla_ov;
  std::vector<Backend::MatmulTask> mla_tasks;
  std::vector<WeightMatrix> mla_heads;
  // Sparse attention (HParams::dsa), else empty: the indexer's queries [B][n_head *
  // head_dim], keys [B][head_dim] and head weights [B][n_head]; the dot products of a chunk
  // of query heads with the key rows (grown on demand), and host copies; per token t of the
  // step, the keys the last full layer kept: sel_n[t] rows and positions at t * top_k of
  // sel_rows / sel_pos, sel_n[t] == 0 meaning every visible key (no more than top_k).
  size_t n_idx_q_ = 0, n_idx_k_ = 0, n_idx_w_ = 0;
  BackendBuffer<float> idx_q, idx_k, idx_w, idx_dots;
  std::vector<float> idx_k_host, idx_w_host, idx_dots_host;
  std::vector<int32_t> sel_rows, sel_pos, sel_n;
  std::vector<std::pair<float, int32_t>> sel_scored;
  std::vector<float> sel_sum;
  std::vector<Backend::StoreRowsTask> idx_stores;
  BackendBuffer<float> logits;     // device backends: [n_out][n_vocab], grown on demand
  BackendBuffer<float> nextn_cat;  // forward_nextn's [B][2 * n_embd] concatenation, on demand
  // Mixture-of-experts scratch: router probabilities [B][n_expert], the chosen experts and
  // their weights [B][n_expert_used], and the rows routed to one expert gathered together.
  BackendBuffer<float> router, moe_in, moe_out;
  std::vector<float> router_host;  // device backends: the probabilities the host routes by
  std::vector<float> sel_w;
  std::vector<int32_t> sel_e, moe_rows;
  std::vector<float> moe_row_w;
  // The one-token MoE path: its experts by ascending id, their views (pins held while the
  // layer computes) and the matvec tasks handed to Backend::matmul_batch.
  std::vector<int32_t> moe_order;
  std::vector<moe::ExpertWeights> moe_held;
  std::vector<Backend::MatmulTask> moe_tasks;
  // The attention block's per-sequence ops, gathered to run as one backend op each.
  std::vector<Backend::StoreRowsTask> store_tasks;
  std::vector<AttentionArgs> attn_args;
  std::vector<const f16*> plane_check;
  std::vector<float> capture_host;  // device backends: a captured activation on its way out
};

// One step of NextN (MTP) block `nextn` (an index of HParams::nextn_layers). Row t's input
// is eh_proj(concat(enorm(e_t), hnorm(hidden_t))): e_t the token's embedding (the block's
// embed_tokens, else the model's), zeroed at position 0 as vLLM's MTP layers do, hidden_t row
// t of `hidden` ([n_tok][n_embd], host memory); then the block (batch.kv holds its one
// LayerKv), shared_head_norm and the head (shared_head_head, else the model's output) into
// `logits` as forward() does. `hidden_out` ([n_tok][n_embd], host memory, may be empty)
// receives the block's output rows before the head norm: the next draft's hidden state. `st`
// must have been made from the whole model's HParams (it sizes for the NextN blocks too).
void forward_nextn(const HParams& hp, const Weights& w, int32_t nextn, Backend& be,
                   ForwardState& st, const ForwardBatch& batch, std::span<const float> hidden,
                   std::span<float> logits, std::span<float> hidden_out);

// Runs one step. `logits` receives [n_out][n_vocab] with n_out = n_tok (all_logits), else 1
// (one sequence) or the rows the sequences ask for (see `seqs`).
void forward(const HParams& hp, const Weights& w, Backend& be, ForwardState& st,
             const ForwardBatch& batch, std::span<float> logits);

}  // namespace kiln::model
