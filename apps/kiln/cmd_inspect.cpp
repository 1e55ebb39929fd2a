// apps/kiln/cmd_inspect.cpp: `kiln inspect FILE`: a GGUF file's metadata and tensor index.
#include <fmt/format.h>

#include <string>

#include "apps/kiln/commands.h"
#include "format/gguf.h"

namespace kiln::app {
namespace {

std::string render_value(const GgufValue& v, size_t max_items) {
  switch (v.type) {
    case GgufType::STRING: {
      std::string s = v.str();
      if (s.size() > 200) s = s.substr(0, 200) + fmt::format("... ({} bytes)", v.str().size());
      std::string out;
      for (char c : s) out += (c == '\n') ? std::string("\\n") : std::string(1, c);
      return "\"" + out + "\"";
    }
    case GgufType::BOOL: return std::get<bool>(v.v) ? "true" : "false";
    case GgufType::FLOAT32: case GgufType::FLOAT64: return fmt::format("{}", std::get<double>(v.v));
    case GgufType::ARRAY: {
      const GgufArray& a = v.arr();
      std::string out = fmt::format("[{} x {}] [", a.items.size(), gguf_type_name(a.elem_type));
      for (size_t i = 0; i < a.items.size() && i < max_items; ++i)
        out += (i ? ", " : "") + render_value(a.items[i], max_items);
      if (a.items.size() > max_items) out += ", ...";
      return out + "]";
    }
    default:
      if (std::holds_alternative<uint64_t>(v.v)) return fmt::format("{}", std::get<uint64_t>(v.v));
      return fmt::format("{}", std::get<int64_t>(v.v));
  }
}

int run_inspect(const std::string& path) {
  auto g = GgufFile::open(path);
  if (!g) {
    fmt::print(stderr, "kiln inspect: {}\n", g.error());
    return 1;
  }
  fmt::print("file: {}\nversion: {}\nalignment: {}\ndata offset: {}\n", path, g->version(),
             g->alignment(), g->data_offset());
  fmt::print("metadata: {} keys\n", g->metadata().size());
  for (const GgufKV& kv : g->metadata())
    fmt::print("  {:<40} {:<6} {}\n", kv.key, gguf_type_name(kv.value.type),
               render_value(kv.value, 8));
  uint64_t total = 0;
  int64_t params = 0;
  fmt::print("tensors: {}\n", g->tensors().size());
  for (const TensorInfo& t : g->tensors()) {
    std::string shape;
    for (int d = 0; d < t.n_dims; ++d) shape += (d ? " x " : "") + std::to_string(t.ne[d]);
    fmt::print("  {:<32} {:<6} [{}] {} bytes @ {}\n", t.name, dtype_name(t.dtype), shape,
               t.n_bytes, t.offset);
    total += t.n_bytes;
    params += t.n_elements();
  }
  fmt::print("total: {} tensors, {} parameters, {} bytes of tensor data\n", g->tensors().size(),
             params, total);
  return 0;
}

}  // namespace

void add_inspect_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("inspect", "print a GGUF file's metadata and tensors");
  auto path = std::make_shared<std::string>();
  cmd->add_option("file", *path, "GGUF file")->required();
  cmd->callback([path, &exit_code] { exit_code = run_inspect(*path); });
}

}  // namespace kiln::app
