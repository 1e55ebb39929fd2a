// model/capture.h: named intermediate activations recorded by a forward pass, so the fast
// path can be compared with the reference node by node, and a drafter can read the target's
// hidden states. Names follow llama.cpp's cb() names with the layer as a prefix:
// `blk.3.attn_norm`, `blk.3.attn_out`, `blk.3.ffn_out`, `blk.3.ffn_moe_logits` (router logits
// of MoE layers), `result_norm`, `result_output`.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "backend/backend.h"
#include "core/check.h"

namespace kiln::model {

struct CapturedNode {
  int64_t n_rows = 0;  // tokens of the eval call
  int64_t width = 0;   // values per token
  // [n_rows][width]: host memory (`data`), or, on a capture with a device backend, that
  // backend's memory (`device`, a view into the capture's buffers; `data` empty).
  std::vector<float> data;
  std::span<const float> device;
  bool on_device() const { return !device.empty(); }
};

class Capture {
 public:
  std::map<std::string, CapturedNode> nodes;
  // Non-empty: only these names are recorded (a drafter conditioned on one or two activations
  // should not pay for copying, or on a GPU downloading, every one of them). clear() keeps it.
  std::vector<std::string> only;
  // Non-null: a pass on this backend records its nodes by Backend::copy into buffers the
  // capture owns (ordered with the ops: on a GPU no download and no wait, so a step stays
  // one graph), for a reader on the same backend (a DFlash drafter). The buffers outlive
  // clear() so their addresses repeat from step to step (CUDA graph signatures name memory
  // by address); they must not outlive the backend. Null, or a pass on another backend:
  // host copies.
  Backend* device = nullptr;

  Capture() = default;
  Capture(const Capture&) = delete;
  Capture& operator=(const Capture&) = delete;
  Capture(Capture&&) = default;
  Capture& operator=(Capture&&) = default;

  void clear() { nodes.clear(); }
  bool wants(std::string_view name) const {
    return only.empty() || std::find(only.begin(), only.end(), name) != only.end();
  }
  // `data`: host memory.
  void record(const std::string& name, std::span<const float> data, int64_t n_rows) {
    if (!wants(name)) return;
    CapturedNode& n = node(name, data.size(), n_rows);
    n.data.assign(data.begin(), data.end());
    n.device = {};
  }
  // `data`: memory of `device` (non-null).
  void record_device(const std::string& name, std::span<const float> data, int64_t n_rows) {
    if (!wants(name)) return;
    KILN_CHECK(device != nullptr, "capture of '{}' on the device without a device", name);
    BackendBuffer<float>& buf = buffers_[name];
    if (buf.size() < data.size()) buf = device->alloc<float>(data.size());
    const std::span<float> dst = buf.span().first(data.size());
    device->copy(data, dst);
    CapturedNode& n = node(name, data.size(), n_rows);
    n.data.clear();
    n.device = dst;
  }
  // Rows [first, first + n) of `src` (a node of a capture on `src_be`, host or device) as this
  // capture's `name`: kept on the device when this capture has src_be as its device, else
  // copied to host memory.
  void record_rows(const std::string& name, const CapturedNode& src, Backend& src_be, int64_t first,
                   int64_t n) {
    if (!wants(name)) return;
    const auto off = static_cast<size_t>(first * src.width);
    const auto count = static_cast<size_t>(n * src.width);
    if (!src.on_device())
      return record(name, std::span<const float>(src.data).subspan(off, count), n);
    const std::span<const float> rows = src.device.subspan(off, count);
    if (device == &src_be) return record_device(name, rows, n);
    std::vector<float> host(count);
    src_be.download(rows, std::span<float>(host));
    record(name, host, n);
  }

 private:
  CapturedNode& node(const std::string& name, size_t size, int64_t n_rows) {
    CapturedNode& n = nodes[name];
    n.n_rows = n_rows;
    n.width = n_rows > 0 ? static_cast<int64_t>(size) / n_rows : 0;
    return n;
  }
  std::map<std::string, BackendBuffer<float>> buffers_;
};

}  // namespace kiln::model
