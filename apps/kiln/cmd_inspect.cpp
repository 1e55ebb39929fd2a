// apps/kiln/cmd_inspect.cpp: `kiln inspect FILE [--json]`: a GGUF file's metadata (long arrays
// summarised), tensor index (name, dtype, shape, bytes, offset) and totals.
#include <fmt/format.h>

#include <nlohmann/json.hpp>
#include <string>

#include "apps/kiln/commands.h"
#include "format/gguf.h"

namespace kiln::app {
namespace {

struct InspectOptions {
  std::string path;
  bool json = false;
  size_t max_items = 8;  // array elements shown; 0 = all
};

bool shown(size_t i, size_t max_items) { return max_items == 0 || i < max_items; }

std::string render_value(const GgufValue& v, size_t max_items) {
  switch (v.type) {
    case GgufType::STRING: {
      std::string s = v.str();
      if (s.size() > 200) s = s.substr(0, 200) + fmt::format("... ({} bytes)", v.str().size());
      std::string out;
      for (char c : s) out += (c == '\n') ? std::string("\\n") : std::string(1, c);
      return "\"" + out + "\"";
    }
    case GgufType::BOOL:
      return std::get<bool>(v.v) ? "true" : "false";
    case GgufType::FLOAT32:
    case GgufType::FLOAT64:
      return fmt::format("{}", std::get<double>(v.v));
    case GgufType::ARRAY: {
      const GgufArray& a = v.arr();
      std::string out = fmt::format("[{} x {}] [", a.items.size(), gguf_type_name(a.elem_type));
      for (size_t i = 0; i < a.items.size() && shown(i, max_items); ++i)
        out += (i ? ", " : "") + render_value(a.items[i], max_items);
      if (!shown(a.items.size() - 1, max_items) && !a.items.empty()) out += ", ...";
      return out + "]";
    }
    default:
      if (std::holds_alternative<uint64_t>(v.v)) return fmt::format("{}", std::get<uint64_t>(v.v));
      return fmt::format("{}", std::get<int64_t>(v.v));
  }
}

nlohmann::json json_value(const GgufValue& v, size_t max_items) {
  switch (v.type) {
    case GgufType::STRING:
      return v.str();
    case GgufType::BOOL:
      return std::get<bool>(v.v);
    case GgufType::FLOAT32:
    case GgufType::FLOAT64:
      return std::get<double>(v.v);
    case GgufType::ARRAY: {
      nlohmann::json items = nlohmann::json::array();
      const GgufArray& a = v.arr();
      for (size_t i = 0; i < a.items.size() && shown(i, max_items); ++i)
        items.push_back(json_value(a.items[i], max_items));
      return items;
    }
    default:
      if (std::holds_alternative<uint64_t>(v.v)) return std::get<uint64_t>(v.v);
      return std::get<int64_t>(v.v);
  }
}

std::vector<int64_t> shape_of(const TensorInfo& t) {
  return std::vector<int64_t>(t.ne.begin(), t.ne.begin() + t.n_dims);
}

int print_json(const GgufFile& g, const InspectOptions& o) {
  nlohmann::json j;
  j["file"] = o.path;
  j["version"] = g.version();
  j["alignment"] = g.alignment();
  j["data_offset"] = g.data_offset();
  j["file_size"] = g.file_size();
  nlohmann::json md = nlohmann::json::array();
  for (const GgufKV& kv : g.metadata()) {
    nlohmann::json e;
    e["key"] = kv.key;
    e["type"] = gguf_type_name(kv.value.type);
    if (kv.value.is_array()) {
      const GgufArray& a = kv.value.arr();
      e["elem_type"] = gguf_type_name(a.elem_type);
      e["length"] = a.items.size();
      e["truncated"] = !shown(a.items.size() ? a.items.size() - 1 : 0, o.max_items);
    }
    e["value"] = json_value(kv.value, o.max_items);
    md.push_back(std::move(e));
  }
  j["metadata"] = std::move(md);
  nlohmann::json ts = nlohmann::json::array();
  uint64_t total = 0;
  int64_t params = 0;
  for (const TensorInfo& t : g.tensors()) {
    ts.push_back({{"name", t.name},
                  {"dtype", dtype_name(t.dtype)},
                  {"shape", shape_of(t)},
                  {"n_bytes", t.n_bytes},
                  {"offset", t.offset}});
    total += t.n_bytes;
    params += t.n_elements();
  }
  j["tensors"] = std::move(ts);
  j["totals"] = {{"n_kv", g.metadata().size()},
                 {"n_tensors", g.tensors().size()},
                 {"n_params", params},
                 {"tensor_bytes", total}};
  // GGUF strings need not be valid UTF-8; replace bad bytes rather than throw.
  fmt::print("{}\n", j.dump(1, ' ', false, nlohmann::json::error_handler_t::replace));
  return 0;
}

int print_text(const GgufFile& g, const InspectOptions& o) {
  fmt::print("file: {}\nversion: {}\nalignment: {}\ndata offset: {}\n", o.path, g.version(),
             g.alignment(), g.data_offset());
  fmt::print("metadata: {} keys\n", g.metadata().size());
  for (const GgufKV& kv : g.metadata())
    fmt::print("  {:<40} {:<6} {}\n", kv.key, gguf_type_name(kv.value.type),
               render_value(kv.value, o.max_items));
  uint64_t total = 0;
  int64_t params = 0;
  fmt::print("tensors: {}\n", g.tensors().size());
  for (const TensorInfo& t : g.tensors()) {
    fmt::print("  {:<32} {:<6} [{}] {} bytes @ {}\n", t.name, dtype_name(t.dtype),
               fmt::join(shape_of(t), " x "), t.n_bytes, t.offset);
    total += t.n_bytes;
    params += t.n_elements();
  }
  fmt::print("total: {} tensors, {} parameters, {} bytes of tensor data\n", g.tensors().size(),
             params, total);
  return 0;
}

int run_inspect(const InspectOptions& o) {
  auto g = GgufFile::open(o.path);
  if (!g) {
    fmt::print(stderr, "kiln inspect: {}\n", g.error());
    return 1;
  }
  return o.json ? print_json(*g, o) : print_text(*g, o);
}

}  // namespace

void add_inspect_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("inspect", "print a GGUF file's metadata and tensors");
  auto o = std::make_shared<InspectOptions>();
  cmd->add_option("file", o->path, "GGUF file")->required();
  cmd->add_flag("--json", o->json, "machine-readable JSON on stdout");
  cmd->add_option("--array-items", o->max_items,
                  "array elements shown per metadata array (0 = all)")
      ->capture_default_str();
  cmd->callback([o, &exit_code] { exit_code = run_inspect(*o); });
}

}  // namespace kiln::app
