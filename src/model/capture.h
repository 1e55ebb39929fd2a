// model/capture.h: named intermediate activations recorded by a forward pass, so the fast
// path can be compared with the reference node by node. Names follow llama.cpp's cb() names
// with the layer as a prefix: `blk.3.attn_norm`, `blk.3.attn_out`, `blk.3.ffn_out`,
// `blk.3.ffn_moe_logits` (router logits of MoE layers), `result_norm`, `result_output`.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

namespace kiln::model {

struct CapturedNode {
  int64_t n_rows = 0;       // tokens of the eval call
  int64_t width = 0;        // values per token
  std::vector<float> data;  // [n_rows][width]
};

struct Capture {
  std::map<std::string, CapturedNode> nodes;
  // Non-empty: only these names are recorded (a drafter that reads one node of every step
  // does not pay for copying all the others).
  std::vector<std::string> only;

  bool wants(const std::string& name) const {
    if (only.empty()) return true;
    for (const std::string& o : only)
      if (o == name) return true;
    return false;
  }

  void clear() { nodes.clear(); }
  void record(const std::string& name, std::span<const float> data, int64_t n_rows) {
    CapturedNode& n = nodes[name];
    n.n_rows = n_rows;
    n.width = n_rows > 0 ? static_cast<int64_t>(data.size()) / n_rows : 0;
    n.data.assign(data.begin(), data.end());
  }
};

}  // namespace kiln::model
