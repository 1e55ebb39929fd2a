// model/capture.h: named intermediate activations recorded by a forward pass, so the fast
// path can be compared with the reference node by node. Names follow llama.cpp's cb() names
// with the layer as a prefix: `blk.3.attn_norm`, `blk.3.attn_out`, `blk.3.ffn_out`,
// `blk.3.ffn_moe_logits` (router logits of MoE layers), `result_norm`, `result_output`.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kiln::model {

struct CapturedNode {
  int64_t n_rows = 0;       // tokens of the eval call
  int64_t width = 0;        // values per token
  std::vector<float> data;  // [n_rows][width]
};

struct Capture {
  std::map<std::string, CapturedNode> nodes;
  // Non-empty: only these names are recorded (a drafter conditioned on one or two activations
  // should not pay for copying, or on a GPU downloading, every one of them). clear() keeps it.
  std::vector<std::string> only;

  void clear() { nodes.clear(); }
  bool wants(std::string_view name) const {
    return only.empty() || std::find(only.begin(), only.end(), name) != only.end();
  }
  void record(const std::string& name, std::span<const float> data, int64_t n_rows) {
    if (!wants(name)) return;
    CapturedNode& n = nodes[name];
    n.n_rows = n_rows;
    n.width = n_rows > 0 ? static_cast<int64_t>(data.size()) / n_rows : 0;
    n.data.assign(data.begin(), data.end());
  }
};

}  // namespace kiln::model
