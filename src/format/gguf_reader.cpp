// format/gguf_reader.cpp: parsing and validating GGUF headers. Every read is bounds-checked
// against the file size before it happens, every count is checked against the bytes that
// could hold it before anything is reserved, and every size computation is overflow-checked.
#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>

#include "core/check.h"
#include "format/gguf.h"

namespace kiln {

namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" little-endian

bool valid_utf8(std::string_view s) {
  size_t i = 0;
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  while (i < n) {
    unsigned c = p[i];
    size_t len;
    uint32_t cp;
    if (c < 0x80) {
      ++i;
      continue;
    }
    if ((c & 0xE0) == 0xC0) {
      len = 2;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4;
      cp = c & 0x07;
    } else
      return false;
    if (i + len > n) return false;
    for (size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) ||
        cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
      return false;
    i += len;
  }
  return true;
}

// Minimum bytes one element of a type occupies on disk (strings: the 8-byte length).
uint64_t min_encoded_size(GgufType t) {
  switch (t) {
    case GgufType::UINT8:
    case GgufType::INT8:
    case GgufType::BOOL:
      return 1;
    case GgufType::UINT16:
    case GgufType::INT16:
      return 2;
    case GgufType::UINT32:
    case GgufType::INT32:
    case GgufType::FLOAT32:
      return 4;
    case GgufType::UINT64:
    case GgufType::INT64:
    case GgufType::FLOAT64:
      return 8;
    case GgufType::STRING:
      return 8;
    case GgufType::ARRAY:
      return 12;
  }
  return 1;
}

// Counts from the file are only trusted up to this many elements for reserve(): each parsed
// element costs tens of bytes, so reserving a count that merely fits the file's byte size
// would let a crafted header allocate several times the file's size up front.
constexpr uint64_t kReserveLimit = 4096;

bool known_type(uint32_t t) { return t <= static_cast<uint32_t>(GgufType::FLOAT64); }

// Names from the file as they appear in error messages: control bytes escaped (a name with a
// newline must not split the one-line error) and long names cut.
std::string shown(std::string_view s) {
  constexpr size_t kMax = 80;
  std::string out;
  for (size_t i = 0; i < s.size() && i < kMax; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c == 0x7F)
      out += fmt::format("\\x{:02x}", c);
    else
      out += static_cast<char>(c);
  }
  if (s.size() > kMax) out += fmt::format("... ({} bytes)", s.size());
  return out;
}

}  // namespace

std::string_view gguf_type_name(GgufType t) {
  static constexpr std::string_view names[] = {"u8",   "i8",  "u16",   "i16", "u32", "i32", "f32",
                                               "bool", "str", "array", "u64", "i64", "f64"};
  auto i = static_cast<uint32_t>(t);
  return i < std::size(names) ? names[i] : std::string_view("?");
}

bool GgufValue::is_integer() const {
  switch (type) {
    case GgufType::UINT8:
    case GgufType::INT8:
    case GgufType::UINT16:
    case GgufType::INT16:
    case GgufType::UINT32:
    case GgufType::INT32:
    case GgufType::UINT64:
    case GgufType::INT64:
      return true;
    default:
      return false;
  }
}

class GgufParser {
 public:
  explicit GgufParser(std::shared_ptr<const MappedFile> f) : f_(std::move(f)) {}

  Expected<GgufFile> run() {
    GgufFile g;
    g.file_ = f_;
    const uint64_t size = f_->size();
    uint32_t magic = 0;
    if (!read_raw(&magic, 4)) return fail("file is {} bytes, too short for the GGUF magic", size);
    if (magic != kMagic) {
      char m[4];
      std::memcpy(m, &magic, 4);
      return fail("not a GGUF file: magic bytes are {:02x} {:02x} {:02x} {:02x}, expected 'GGUF'",
                  uint8_t(m[0]), uint8_t(m[1]), uint8_t(m[2]), uint8_t(m[3]));
    }
    uint32_t version = 0;
    if (!read_raw(&version, 4))
      return fail("truncated at the version field (file is {} bytes)", size);
    if (version == 1) return fail("GGUF version 1 is not supported (only versions 2 and 3)");
    if ((version & 0xFFFF) == 0 && version != 0)
      return fail("GGUF version field {:#x} looks byte-swapped: big-endian files are not supported",
                  version);
    if (version != 2 && version != 3)
      return fail("unsupported GGUF version {} (only versions 2 and 3)", version);
    g.version_ = version;

    uint64_t n_tensors = 0, n_kv = 0;
    if (!read_raw(&n_tensors, 8)) return fail("truncated at the tensor count");
    if (!read_raw(&n_kv, 8)) return fail("truncated at the metadata count");
    // Each key/value pair needs at least 8 (key length) + 4 (type) + 1 bytes; each tensor
    // info at least 8 + 4 + 8 + 4 + 8 bytes. Counts that could not fit are rejected before
    // anything is reserved.
    if (n_kv > remaining() / 13)
      return fail("metadata count {} cannot fit in the {} bytes left in the file", n_kv,
                  remaining());
    if (n_tensors > remaining() / 32)
      return fail("tensor count {} cannot fit in the {} bytes left in the file", n_tensors,
                  remaining());

    g.kvs_.reserve(std::min<uint64_t>(n_kv, kReserveLimit));
    for (uint64_t i = 0; i < n_kv; ++i) {
      GgufKV kv;
      if (!read_string(kv.key)) return fail("metadata pair {}: {}", i, err_);
      if (kv.key.empty()) return fail("metadata pair {}: empty key", i);
      if (!valid_utf8(kv.key)) return fail("metadata pair {}: key is not valid UTF-8", i);
      uint32_t type = 0;
      if (!read_raw(&type, 4)) return fail("metadata '{}': truncated at its type", shown(kv.key));
      if (!known_type(type))
        return fail("metadata '{}': unknown value type {}", shown(kv.key), type);
      if (!read_value(static_cast<GgufType>(type), kv.value, 0))
        return fail("metadata '{}': {}", shown(kv.key), err_);
      if (g.kv_index_.count(kv.key)) return fail("duplicate metadata key '{}'", shown(kv.key));
      g.kv_index_.emplace(kv.key, g.kvs_.size());
      g.kvs_.push_back(std::move(kv));
    }

    if (const GgufValue* a = g.find("general.alignment")) {
      if (!a->is_integer())
        return fail("general.alignment has type {}, expected an integer", gguf_type_name(a->type));
      auto al = gguf_convert<uint64_t>(*a, "general.alignment");
      if (!al || *al == 0 || (*al & (*al - 1)) != 0 || *al > (1u << 30))
        return fail("general.alignment must be a power of two (got {})",
                    a->type == GgufType::INT8 || a->type == GgufType::INT16 ||
                            a->type == GgufType::INT32 || a->type == GgufType::INT64
                        ? std::get<int64_t>(a->v)
                        : static_cast<int64_t>(std::get<uint64_t>(a->v)));
      g.alignment_ = *al;
    }

    g.tensors_.reserve(std::min<uint64_t>(n_tensors, kReserveLimit));
    for (uint64_t i = 0; i < n_tensors; ++i) {
      TensorInfo t;
      if (!read_string(t.name)) return fail("tensor {}: name: {}", i, err_);
      if (t.name.empty()) return fail("tensor {}: empty name", i);
      if (t.name.size() > kMaxTensorName)
        return fail("tensor {}: name is {} bytes long (at most {})", i, t.name.size(),
                    kMaxTensorName);
      uint32_t n_dims = 0;
      if (!read_raw(&n_dims, 4)) return fail("tensor '{}': truncated at n_dims", shown(t.name));
      if (n_dims < 1 || n_dims > kMaxDims)
        return fail("tensor '{}': n_dims is {} (must be 1..{})", shown(t.name), n_dims, kMaxDims);
      t.n_dims = static_cast<int>(n_dims);
      for (uint32_t d = 0; d < n_dims; ++d) {
        int64_t ne = 0;
        if (!read_raw(&ne, 8)) return fail("tensor '{}': truncated in its shape", shown(t.name));
        if (ne < 1)
          return fail("tensor '{}': dimension {} is {} (must be >= 1)", shown(t.name), d, ne);
        t.ne[d] = ne;
      }
      uint32_t type = 0;
      if (!read_raw(&type, 4)) return fail("tensor '{}': truncated at its type", shown(t.name));
      auto tr = dtype_traits(type);
      if (!tr) return fail("tensor '{}': unknown tensor type {}", shown(t.name), type);
      t.dtype = static_cast<DType>(type);
      if (!read_raw(&t.offset, 8))
        return fail("tensor '{}': truncated at its offset", shown(t.name));

      // Element count and byte size, each multiplication checked against overflow.
      int64_t n_el = 1;
      for (int d = 0; d < kMaxDims; ++d) {
        if (__builtin_mul_overflow(n_el, t.ne[d], &n_el))
          return fail("tensor '{}': shape [{}, {}, {}, {}] overflows 64 bits", shown(t.name),
                      t.ne[0], t.ne[1], t.ne[2], t.ne[3]);
      }
      if (t.ne[0] % tr->block_size != 0)
        return fail("tensor '{}': row length {} is not a multiple of the {} block size {}",
                    shown(t.name), t.ne[0], tr->name, tr->block_size);
      uint64_t n_bytes = 0;
      if (__builtin_mul_overflow(static_cast<uint64_t>(n_el / tr->block_size),
                                 static_cast<uint64_t>(tr->type_size), &n_bytes))
        return fail("tensor '{}': byte size overflows 64 bits", shown(t.name));
      t.n_bytes = n_bytes;
      if (t.offset % g.alignment_ != 0)
        return fail("tensor '{}': offset {} is not a multiple of the alignment {}", shown(t.name),
                    t.offset, g.alignment_);
      if (g.tensor_index_.count(t.name)) return fail("duplicate tensor name '{}'", shown(t.name));
      g.tensor_index_.emplace(t.name, g.tensors_.size());
      g.tensors_.push_back(std::move(t));
    }

    // The data section starts at the next alignment boundary after the header.
    const uint64_t header_end = pos_;
    uint64_t data_offset = round_up(header_end, g.alignment_);
    g.data_offset_ = data_offset;
    const uint64_t data_size = data_offset <= size ? size - data_offset : 0;
    if (!g.tensors_.empty() && data_offset > size)
      return fail("header ends at byte {}, leaving no room for tensor data (file is {} bytes)",
                  header_end, size);
    for (const TensorInfo& t : g.tensors_) {
      uint64_t end = 0;
      if (__builtin_add_overflow(t.offset, t.n_bytes, &end) || end > data_size)
        return fail(
            "tensor '{}': data at offset {} + {} bytes runs past the end of the data "
            "section ({} bytes, file is {} bytes)",
            shown(t.name), t.offset, t.n_bytes, data_size, size);
    }
    // No two tensors may share bytes: sort by offset and compare neighbours.
    std::vector<const TensorInfo*> by_off;
    by_off.reserve(g.tensors_.size());
    for (const TensorInfo& t : g.tensors_) by_off.push_back(&t);
    std::sort(by_off.begin(), by_off.end(),
              [](const TensorInfo* a, const TensorInfo* b) { return a->offset < b->offset; });
    for (size_t i = 1; i < by_off.size(); ++i) {
      const TensorInfo* a = by_off[i - 1];
      const TensorInfo* b = by_off[i];
      if (a->offset + a->n_bytes > b->offset)
        return fail("tensors '{}' (offset {}, {} bytes) and '{}' (offset {}) overlap",
                    shown(a->name), a->offset, a->n_bytes, shown(b->name), b->offset);
    }
    return g;
  }

 private:
  template <typename... Args>
  Status fail(fmt::format_string<Args...> f, Args&&... args) {
    return Status::error(fmt::format("{}: invalid GGUF: {}", f_->name(),
                                     fmt::format(f, std::forward<Args>(args)...)));
  }

  uint64_t remaining() const { return f_->size() - pos_; }

  bool read_raw(void* out, uint64_t n) {
    if (n > remaining()) {
      err_ = fmt::format("truncated: needs {} bytes at offset {}, file is {} bytes", n, pos_,
                         f_->size());
      return false;
    }
    std::memcpy(out, f_->data() + pos_, n);
    pos_ += n;
    return true;
  }

  bool read_string(std::string& out) {
    uint64_t len = 0;
    if (!read_raw(&len, 8)) return false;
    if (len > remaining()) {
      err_ = fmt::format("string length {} at offset {} runs past the end of the file ({} bytes)",
                         len, pos_ - 8, f_->size());
      return false;
    }
    out.assign(reinterpret_cast<const char*>(f_->data() + pos_), len);
    pos_ += len;
    return true;
  }

  template <typename Raw, typename Store>
  bool read_num(GgufValue& v) {
    Raw r{};
    if (!read_raw(&r, sizeof(Raw))) return false;
    v.v = static_cast<Store>(r);
    return true;
  }

  bool read_value(GgufType type, GgufValue& v, int depth) {
    v.type = type;
    switch (type) {
      case GgufType::UINT8:
        return read_num<uint8_t, uint64_t>(v);
      case GgufType::INT8:
        return read_num<int8_t, int64_t>(v);
      case GgufType::UINT16:
        return read_num<uint16_t, uint64_t>(v);
      case GgufType::INT16:
        return read_num<int16_t, int64_t>(v);
      case GgufType::UINT32:
        return read_num<uint32_t, uint64_t>(v);
      case GgufType::INT32:
        return read_num<int32_t, int64_t>(v);
      case GgufType::UINT64:
        return read_num<uint64_t, uint64_t>(v);
      case GgufType::INT64:
        return read_num<int64_t, int64_t>(v);
      case GgufType::FLOAT32:
        return read_num<float, double>(v);
      case GgufType::FLOAT64:
        return read_num<double, double>(v);
      case GgufType::BOOL: {
        uint8_t b = 0;
        if (!read_raw(&b, 1)) return false;
        if (b > 1) {
          err_ = fmt::format("bool value {} at offset {} is neither 0 nor 1", b, pos_ - 1);
          return false;
        }
        v.v = b != 0;
        return true;
      }
      case GgufType::STRING: {
        std::string s;
        if (!read_string(s)) return false;
        v.v = std::move(s);
        return true;
      }
      case GgufType::ARRAY: {
        if (depth >= kMaxArrayNesting) {
          err_ = fmt::format("arrays nested more than {} deep", kMaxArrayNesting);
          return false;
        }
        uint32_t et = 0;
        uint64_t n = 0;
        if (!read_raw(&et, 4)) return false;
        if (!known_type(et)) {
          err_ = fmt::format("array of unknown element type {}", et);
          return false;
        }
        if (!read_raw(&n, 8)) return false;
        const GgufType elem = static_cast<GgufType>(et);
        if (n > remaining() / min_encoded_size(elem)) {
          err_ = fmt::format("array of {} {} elements cannot fit in the {} bytes left", n,
                             gguf_type_name(elem), remaining());
          return false;
        }
        if (n > array_budget_) {
          err_ = fmt::format(
              "array of {} elements exceeds the limit of {} array elements in "
              "all metadata",
              n, kMaxArrayElements);
          return false;
        }
        array_budget_ -= n;
        GgufArray a;
        a.elem_type = elem;
        // Grown as elements are actually read: a count that passed the size check but whose
        // elements turn out malformed costs memory only for what was parsed.
        a.items.reserve(std::min<uint64_t>(n, kReserveLimit));
        for (uint64_t i = 0; i < n; ++i) {
          if (!read_value(elem, a.items.emplace_back(), depth + 1)) return false;
        }
        v.v = std::move(a);
        return true;
      }
    }
    err_ = "unknown type";
    return false;
  }

  std::shared_ptr<const MappedFile> f_;
  uint64_t pos_ = 0;
  uint64_t array_budget_ = kMaxArrayElements;
  std::string err_;
};

Expected<GgufFile> GgufFile::open(const std::string& path) {
  auto f = MappedFile::open(path);
  if (!f) return f.status();
  return parse(std::move(*f));
}

Expected<GgufFile> GgufFile::parse(std::shared_ptr<const MappedFile> file) {
  GgufParser p(std::move(file));
  return p.run();
}

const GgufValue* GgufFile::find(std::string_view key) const {
  auto it = kv_index_.find(std::string(key));
  return it == kv_index_.end() ? nullptr : &kvs_[it->second].value;
}

const TensorInfo* GgufFile::find_tensor(std::string_view name) const {
  auto it = tensor_index_.find(std::string(name));
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

TensorView GgufFile::view(const TensorInfo& t) const {
  // Safe without re-checking: parse() proved offset + n_bytes <= data section for every
  // TensorInfo it produced, and TensorInfos are only made there.
  TensorView v;
  v.info = &t;
  v.bytes = file_->bytes().subspan(data_offset_ + t.offset, t.n_bytes);
  return v;
}

Expected<TensorView> GgufFile::tensor(std::string_view name) const {
  const TensorInfo* t = find_tensor(name);
  if (!t) return Status::errorf("{}: tensor '{}' not found", path(), name);
  return view(*t);
}

std::span<const std::byte> TensorView::row(int64_t r) const {
  KILN_CHECK(r >= 0 && r < n_rows(), "row {} of tensor '{}' with {} rows", r, info->name, n_rows());
  const uint64_t rb = row_bytes();
  return bytes.subspan(static_cast<uint64_t>(r) * rb, rb);
}

template <typename T>
Expected<T> gguf_convert(const GgufValue& v, std::string_view what) {
  auto wrong = [&](std::string_view want) {
    return Status::errorf("'{}' has type {}, expected {}", what, gguf_type_name(v.type), want);
  };
  if constexpr (std::is_same_v<T, bool>) {
    if (v.type != GgufType::BOOL) return wrong("bool");
    return std::get<bool>(v.v);
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (v.type != GgufType::STRING) return wrong("string");
    return std::get<std::string>(v.v);
  } else if constexpr (std::is_floating_point_v<T>) {
    if (v.is_float()) return static_cast<T>(std::get<double>(v.v));
    if (v.is_integer()) {
      if (std::holds_alternative<uint64_t>(v.v)) return static_cast<T>(std::get<uint64_t>(v.v));
      return static_cast<T>(std::get<int64_t>(v.v));
    }
    return wrong("a number");
  } else if constexpr (std::is_integral_v<T>) {
    if (!v.is_integer()) return wrong("an integer");
    if (std::holds_alternative<uint64_t>(v.v)) {
      uint64_t x = std::get<uint64_t>(v.v);
      if (x > static_cast<uint64_t>(std::numeric_limits<T>::max()))
        return Status::errorf("'{}' is {}, which does not fit the expected integer type", what, x);
      return static_cast<T>(x);
    }
    int64_t x = std::get<int64_t>(v.v);
    if (std::is_unsigned_v<T> && x < 0)
      return Status::errorf("'{}' is {}, expected a non-negative value", what, x);
    if (!std::is_unsigned_v<T> && (x < static_cast<int64_t>(std::numeric_limits<T>::min()) ||
                                   x > static_cast<int64_t>(std::numeric_limits<T>::max())))
      return Status::errorf("'{}' is {}, which does not fit the expected integer type", what, x);
    if (std::is_unsigned_v<T> && static_cast<uint64_t>(x) > std::numeric_limits<T>::max())
      return Status::errorf("'{}' is {}, which does not fit the expected integer type", what, x);
    return static_cast<T>(x);
  } else {
    static_assert(sizeof(T) == 0, "unsupported GGUF accessor type");
  }
}

template <typename T>
Expected<T> GgufFile::get(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return Status::errorf("{}: metadata key '{}' not found", path(), key);
  auto r = gguf_convert<T>(*v, key);
  if (!r) return Status::errorf("{}: metadata {}", path(), r.error());
  return r;
}

template <typename T>
Expected<std::vector<T>> GgufFile::get_array(std::string_view key) const {
  const GgufValue* v = find(key);
  if (!v) return Status::errorf("{}: metadata key '{}' not found", path(), key);
  if (!v->is_array())
    return Status::errorf("{}: metadata '{}' has type {}, expected an array", path(), key,
                          gguf_type_name(v->type));
  std::vector<T> out;
  out.reserve(v->arr().items.size());
  size_t i = 0;
  for (const GgufValue& e : v->arr().items) {
    auto r = gguf_convert<T>(e, fmt::format("{}[{}]", key, i++));
    if (!r) return Status::errorf("{}: metadata {}", path(), r.error());
    out.push_back(std::move(*r));
  }
  return out;
}

#define KILN_GGUF_INSTANTIATE(T)                                            \
  template Expected<T> gguf_convert<T>(const GgufValue&, std::string_view); \
  template Expected<T> GgufFile::get<T>(std::string_view) const;            \
  template Expected<std::vector<T>> GgufFile::get_array<T>(std::string_view) const;
KILN_GGUF_INSTANTIATE(bool)
KILN_GGUF_INSTANTIATE(std::string)
KILN_GGUF_INSTANTIATE(float)
KILN_GGUF_INSTANTIATE(double)
KILN_GGUF_INSTANTIATE(uint8_t)
KILN_GGUF_INSTANTIATE(int8_t)
KILN_GGUF_INSTANTIATE(uint16_t)
KILN_GGUF_INSTANTIATE(int16_t)
KILN_GGUF_INSTANTIATE(uint32_t)
KILN_GGUF_INSTANTIATE(int32_t)
KILN_GGUF_INSTANTIATE(uint64_t)
KILN_GGUF_INSTANTIATE(int64_t)
#undef KILN_GGUF_INSTANTIATE

}  // namespace kiln
