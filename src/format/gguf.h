// format/gguf.h: the GGUF reader. `GgufFile::open` maps a file once and validates the
// whole header (metadata, tensor index) before returning; afterwards every tensor is a
// checked view into that one mapping. Nothing here copies weight bytes.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <variant>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"
#include "format/mmap_file.h"

namespace kiln {

enum class GgufType : uint32_t {
  UINT8 = 0,
  INT8 = 1,
  UINT16 = 2,
  INT16 = 3,
  UINT32 = 4,
  INT32 = 5,
  FLOAT32 = 6,
  BOOL = 7,
  STRING = 8,
  ARRAY = 9,
  UINT64 = 10,
  INT64 = 11,
  FLOAT64 = 12,
};
std::string_view gguf_type_name(GgufType t);

struct GgufValue;
struct GgufArray {
  GgufType elem_type = GgufType::UINT8;
  std::vector<GgufValue> items;
};

// One metadata value. Integers keep their declared GGUF type in `type`; the payload is
// widened (unsigned -> uint64_t, signed -> int64_t, floats -> double).
struct GgufValue {
  GgufType type = GgufType::UINT8;
  std::variant<uint64_t, int64_t, double, bool, std::string, GgufArray> v;

  bool is_integer() const;
  bool is_float() const { return type == GgufType::FLOAT32 || type == GgufType::FLOAT64; }
  bool is_string() const { return type == GgufType::STRING; }
  bool is_array() const { return type == GgufType::ARRAY; }
  const std::string& str() const { return std::get<std::string>(v); }
  const GgufArray& arr() const { return std::get<GgufArray>(v); }
};

struct GgufKV {
  std::string key;
  GgufValue value;
};

inline constexpr int kMaxDims = 4;
inline constexpr size_t kMaxTensorName = 63;  // llama.cpp's GGML_MAX_NAME - 1
inline constexpr int kMaxArrayNesting = 8;
// Array elements in all metadata together. Each parsed element costs ~50 bytes of memory, so
// without a cap a crafted file could make the reader allocate ~50x its own size (the cap
// bounds that at ~200 MB). The largest real vocabularies (262k tokens with scores and types,
// or 150k tokens with as many merges) use under 1M.
inline constexpr uint64_t kMaxArrayElements = uint64_t{1} << 22;

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  int n_dims = 0;
  std::array<int64_t, kMaxDims> ne{1, 1, 1, 1};  // ggml order: ne[0] is the row length
  uint64_t offset = 0;                           // from the start of the data section
  uint64_t n_bytes = 0;

  int64_t n_elements() const { return ne[0] * ne[1] * ne[2] * ne[3]; }
  int64_t n_rows() const { return ne[1] * ne[2] * ne[3]; }
};

// A borrowed, checked view of one tensor's bytes inside the mapping. Only GgufFile makes
// these, from validated TensorInfo, so data..data+n_bytes always lies inside the file.
struct TensorView {
  const TensorInfo* info = nullptr;
  std::span<const std::byte> bytes;

  DType dtype() const { return info->dtype; }
  int64_t row_length() const { return info->ne[0]; }
  int64_t n_rows() const { return info->n_rows(); }
  uint64_t row_bytes() const { return info->n_bytes / static_cast<uint64_t>(info->n_rows()); }
  // Bytes of row r (rows are ne[0] elements, flattened over ne[1..3]); r is range-checked.
  std::span<const std::byte> row(int64_t r) const;
};

class GgufFile {
 public:
  static Expected<GgufFile> open(const std::string& path);
  // Parses bytes already in memory (the fuzz target uses this).
  static Expected<GgufFile> parse(std::shared_ptr<const MappedFile> file);

  const std::string& path() const { return file_->name(); }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }  // absolute file offset of tensor data
  uint64_t file_size() const { return file_->size(); }
  const std::shared_ptr<const MappedFile>& mapping() const { return file_; }

  const std::vector<GgufKV>& metadata() const { return kvs_; }
  const GgufValue* find(std::string_view key) const;
  bool has(std::string_view key) const { return find(key) != nullptr; }

  // Typed accessors. Integers convert between widths when the value fits; strings, bools,
  // floats and arrays must match. The error names the key, the stored type and the value.
  template <typename T>
  Expected<T> get(std::string_view key) const;
  // Like get(), but a missing key yields `fallback`; a present key of the wrong type is
  // still an error.
  template <typename T>
  Expected<T> get_or(std::string_view key, T fallback) const {
    if (!has(key)) return fallback;
    return get<T>(key);
  }
  template <typename T>
  Expected<std::vector<T>> get_array(std::string_view key) const;

  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find_tensor(std::string_view name) const;
  TensorView view(const TensorInfo& t) const;
  Expected<TensorView> tensor(std::string_view name) const;

 private:
  std::shared_ptr<const MappedFile> file_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::vector<GgufKV> kvs_;
  std::unordered_map<std::string, size_t> kv_index_;
  std::vector<TensorInfo> tensors_;
  std::unordered_map<std::string, size_t> tensor_index_;
  friend class GgufParser;
};

// Converts one value to T with the rules of GgufFile::get (used for array elements too).
template <typename T>
Expected<T> gguf_convert(const GgufValue& v, std::string_view what);

}  // namespace kiln
