// moe/expert_source.cpp: the mapped-file ExpertSource (slices of the stacked tensors).
#include "moe/expert_source.h"

#include "core/check.h"

namespace kiln::moe {

MappedExpertSource::MappedExpertSource(std::vector<StackedExperts> layers)
    : layers_(std::move(layers)) {
  for (const StackedExperts& l : layers_) {
    if (l.n_expert == 0) continue;
    KILN_CHECK(l.n_expert > 0 && l.gate.n_rows % l.n_expert == 0 && l.up.n_rows == l.gate.n_rows &&
               l.down.n_rows % l.n_expert == 0);
  }
}

int32_t MappedExpertSource::n_expert(int32_t layer) const {
  KILN_CHECK(layer >= 0 && layer < n_layer(), "layer {} of {}", layer, n_layer());
  return layers_[layer].n_expert;
}

ExpertWeights MappedExpertSource::get(int32_t layer, int32_t expert) {
  KILN_CHECK(layer >= 0 && layer < n_layer(), "layer {} of {}", layer, n_layer());
  const StackedExperts& l = layers_[layer];
  KILN_CHECK(expert >= 0 && expert < l.n_expert, "expert {} of {} in layer {}", expert, l.n_expert,
             layer);
  const int64_t ff = l.gate.n_rows / l.n_expert, emb = l.down.n_rows / l.n_expert;
  return ExpertWeights{.gate = l.gate.rows(expert * ff, ff),
                       .up = l.up.rows(expert * ff, ff),
                       .down = l.down.rows(expert * emb, emb),
                       .hold = nullptr};
}

}  // namespace kiln::moe
