// tests/fuzz/fuzz_gguf.cpp: libFuzzer target for the GGUF reader. Parses arbitrary bytes; when
// they parse, touches every tensor view and every typed accessor, and checks the round-trip
// property: what the reader accepts, the writer re-serialises and the reader accepts again
// with the same index.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "format/gguf.h"
#include "format/gguf_writer.h"
#include "memory/bytes.h"

namespace {

using namespace kiln;

volatile uint64_t g_sink;  // keeps reads from being optimised away

void touch_value(const GgufFile& g, const GgufKV& kv) {
  const std::string& k = kv.key;
  // Every accessor either succeeds or returns an error; neither may crash.
  g_sink = g_sink + g.get<bool>(k).has_value() + g.get<std::string>(k).has_value() +
           g.get<float>(k).has_value() + g.get<double>(k).has_value() +
           g.get<uint8_t>(k).has_value() + g.get<int8_t>(k).has_value() +
           g.get<uint16_t>(k).has_value() + g.get<int16_t>(k).has_value() +
           g.get<uint32_t>(k).has_value() + g.get<int32_t>(k).has_value() +
           g.get<uint64_t>(k).has_value() + g.get<int64_t>(k).has_value();
  g_sink = g_sink + g.get_array<std::string>(k).has_value() + g.get_array<float>(k).has_value() +
           g.get_array<int32_t>(k).has_value() + g.get_array<uint32_t>(k).has_value() +
           g.get_array<bool>(k).has_value();
  if (auto s = g.get<std::string>(k); s && !s->empty()) g_sink = g_sink + uint8_t((*s)[0]);
}

void touch_tensor(const GgufFile& g, const TensorInfo& t) {
  TensorView v = g.view(t);
  if (v.bytes.size() != t.n_bytes) std::abort();
  if (!v.bytes.empty()) g_sink = g_sink + uint8_t(v.bytes.front()) + uint8_t(v.bytes.back());
  auto first = v.row(0);
  auto last = v.row(v.n_rows() - 1);
  if (!first.empty()) g_sink = g_sink + uint8_t(first[0]) + uint8_t(last[last.size() - 1]);
  Bytes b = Bytes::of_tensor(g, t);
  PageRegion r = page_region(b.span());
  if (r.logical_bytes != t.n_bytes) std::abort();
  if (auto found = g.tensor(t.name); !found || found->info != &t) std::abort();
}

void round_trip(const GgufFile& g) {
  GgufWriter w;
  w.copy_metadata(g);
  for (const TensorInfo& t : g.tensors())
    w.add_tensor(t.name, t.dtype, std::vector<int64_t>(t.ne.begin(), t.ne.begin() + t.n_dims),
                 g.view(t).bytes);
  if (!w.status()) std::abort();  // the reader accepted something the writer cannot express
  if (w.file_size() > (uint64_t{64} << 20)) return;  // huge alignment padding: skip
  auto bytes = w.to_bytes();
  if (!bytes) std::abort();
  auto again = GgufFile::parse(MappedFile::from_bytes(std::move(*bytes)));
  if (!again) std::abort();
  if (again->metadata().size() != g.metadata().size() ||
      again->tensors().size() != g.tensors().size())
    std::abort();
  for (size_t i = 0; i < g.tensors().size(); ++i) {
    const TensorInfo &a = g.tensors()[i], &b = again->tensors()[i];
    if (a.name != b.name || a.ne != b.ne || a.dtype != b.dtype || a.n_bytes != b.n_bytes)
      std::abort();
    if (a.n_bytes && std::memcmp(g.view(a).bytes.data(), again->view(b).bytes.data(), a.n_bytes))
      std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::byte> bytes(reinterpret_cast<const std::byte*>(data),
                               reinterpret_cast<const std::byte*>(data) + size);
  auto g = GgufFile::parse(MappedFile::from_bytes(std::move(bytes), "fuzz.gguf"));
  if (!g) {
    if (g.error().empty() || g.error().find('\n') != std::string::npos) std::abort();
    return 0;
  }
  for (const GgufKV& kv : g->metadata()) touch_value(*g, kv);
  for (const TensorInfo& t : g->tensors()) touch_tensor(*g, t);
  round_trip(*g);
  return 0;
}
