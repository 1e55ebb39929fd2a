// model/tensor_parallel.h: Megatron-style sharding of a model over the ranks of a
// tensor-parallel group (backend/tp_group.h). Rank r of n gets heads [r*H/n, (r+1)*H/n) of
// the queries and of the KV heads (column-parallel Q/K/V/gate rows, its own KV planes), the
// same block of the output projection's columns (row-parallel O), FFN columns likewise
// (column-parallel gate/up rows, row-parallel down columns) and, in MoE layers, a contiguous
// block of whole experts. The forward pass (forward.cpp) sums each row-parallel output over
// the ranks with Backend::all_reduce_sum. Norms, embeddings, the router and the output head
// are replicated. Every shard is a view into the same mapping: nothing is copied here.
#pragma once

#include "core/status.h"
#include "model/hparams.h"
#include "model/weights.h"

namespace kiln::model {

struct Shard {
  HParams hp;
  Weights w;  // views into the model's tensors and its owned vectors: must not outlive it
};

// Rank `rank` of `n` (1 <= n; n == 1 is the whole model, unchanged). Errors name what does
// not divide: the head counts, an FFN width, or a row-parallel slice that is not a whole
// number of its type's quant blocks.
Expected<Shard> shard_model(const HParams& hp, const Weights& w, int rank, int n);

}  // namespace kiln::model
