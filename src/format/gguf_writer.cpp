// format/gguf_writer.cpp: serialising metadata + tensor index + aligned data as GGUF v3.
// Mistakes in what callers add (bad shapes, wrong byte counts, mistyped values) are recorded
// and returned by write(), so a tool fed bad input reports one line instead of aborting.
#include "format/gguf_writer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <type_traits>
#include <unordered_set>

#include "core/check.h"

namespace kiln {

namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" little-endian
constexpr uint32_t kVersion = 3;

// Appends little-endian bytes (the only byte order kiln supports; x86 and arm64 are LE).
class Sink {
 public:
  explicit Sink(std::vector<std::byte>& out) : out_(out) {}
  template <typename T>
  void raw(T v) {
    static_assert(std::is_trivially_copyable_v<T>);
    append(&v, sizeof(T));
  }
  void str(std::string_view s) {
    raw<uint64_t>(s.size());
    append(s.data(), s.size());
  }
  void pad_to(uint64_t align) { out_.resize(round_up(out_.size(), align), std::byte{0}); }

 private:
  // resize + memcpy rather than insert: g++ 12 warns falsely (-Wstringop-overflow) on insert.
  void append(const void* p, size_t n) {
    if (n == 0) return;
    const size_t at = out_.size();
    out_.resize(at + n);
    std::memcpy(out_.data() + at, p, n);
  }

  std::vector<std::byte>& out_;
};

bool is_unsigned_type(GgufType t) {
  return t == GgufType::UINT8 || t == GgufType::UINT16 || t == GgufType::UINT32 ||
         t == GgufType::UINT64;
}
bool is_signed_type(GgufType t) {
  return t == GgufType::INT8 || t == GgufType::INT16 || t == GgufType::INT32 ||
         t == GgufType::INT64;
}

// Checks that the payload alternative matches the declared type (recursively for arrays).
Status check_value(const GgufValue& v, std::string_view key, int depth) {
  auto bad = [&] {
    return Status::errorf("metadata '{}': value payload does not match its type {}", key,
                          gguf_type_name(v.type));
  };
  if (static_cast<uint32_t>(v.type) > static_cast<uint32_t>(GgufType::FLOAT64))
    return Status::errorf("metadata '{}': unknown value type {}", key,
                          static_cast<uint32_t>(v.type));
  if (is_unsigned_type(v.type)) {
    if (!std::holds_alternative<uint64_t>(v.v)) return bad();
    const uint64_t x = std::get<uint64_t>(v.v);
    const uint64_t max = v.type == GgufType::UINT8    ? 0xFFull
                         : v.type == GgufType::UINT16 ? 0xFFFFull
                         : v.type == GgufType::UINT32 ? 0xFFFFFFFFull
                                                      : ~0ull;
    if (x > max)
      return Status::errorf("metadata '{}': {} does not fit type {}", key, x,
                            gguf_type_name(v.type));
  } else if (is_signed_type(v.type)) {
    if (!std::holds_alternative<int64_t>(v.v)) return bad();
    const int64_t x = std::get<int64_t>(v.v);
    const int bits = v.type == GgufType::INT8    ? 8
                     : v.type == GgufType::INT16 ? 16
                     : v.type == GgufType::INT32 ? 32
                                                 : 64;
    if (bits < 64 && (x < -(int64_t(1) << (bits - 1)) || x >= (int64_t(1) << (bits - 1))))
      return Status::errorf("metadata '{}': {} does not fit type {}", key, x,
                            gguf_type_name(v.type));
  } else if (v.is_float()) {
    if (!std::holds_alternative<double>(v.v)) return bad();
  } else if (v.type == GgufType::BOOL) {
    if (!std::holds_alternative<bool>(v.v)) return bad();
  } else if (v.type == GgufType::STRING) {
    if (!std::holds_alternative<std::string>(v.v)) return bad();
  } else if (v.type == GgufType::ARRAY) {
    if (!std::holds_alternative<GgufArray>(v.v)) return bad();
    if (depth >= kMaxArrayNesting)
      return Status::errorf("metadata '{}': arrays nested more than {} deep", key,
                            kMaxArrayNesting);
    const GgufArray& a = v.arr();
    for (size_t i = 0; i < a.items.size(); ++i) {
      if (a.items[i].type != a.elem_type)
        return Status::errorf("metadata '{}': element {} has type {} in an array of {}", key, i,
                              gguf_type_name(a.items[i].type), gguf_type_name(a.elem_type));
      KILN_TRY(check_value(a.items[i], key, depth + 1));
    }
  }
  return Status::ok();
}

void put_value(Sink& s, const GgufValue& v) {
  switch (v.type) {
    case GgufType::UINT8:
      s.raw<uint8_t>(uint8_t(std::get<uint64_t>(v.v)));
      break;
    case GgufType::UINT16:
      s.raw<uint16_t>(uint16_t(std::get<uint64_t>(v.v)));
      break;
    case GgufType::UINT32:
      s.raw<uint32_t>(uint32_t(std::get<uint64_t>(v.v)));
      break;
    case GgufType::UINT64:
      s.raw<uint64_t>(std::get<uint64_t>(v.v));
      break;
    case GgufType::INT8:
      s.raw<int8_t>(int8_t(std::get<int64_t>(v.v)));
      break;
    case GgufType::INT16:
      s.raw<int16_t>(int16_t(std::get<int64_t>(v.v)));
      break;
    case GgufType::INT32:
      s.raw<int32_t>(int32_t(std::get<int64_t>(v.v)));
      break;
    case GgufType::INT64:
      s.raw<int64_t>(std::get<int64_t>(v.v));
      break;
    case GgufType::FLOAT32:
      s.raw<float>(float(std::get<double>(v.v)));
      break;
    case GgufType::FLOAT64:
      s.raw<double>(std::get<double>(v.v));
      break;
    case GgufType::BOOL:
      s.raw<uint8_t>(std::get<bool>(v.v) ? 1 : 0);
      break;
    case GgufType::STRING:
      s.str(v.str());
      break;
    case GgufType::ARRAY: {
      const GgufArray& a = v.arr();
      s.raw<uint32_t>(static_cast<uint32_t>(a.elem_type));
      s.raw<uint64_t>(a.items.size());
      for (const GgufValue& e : a.items) put_value(s, e);
      break;
    }
  }
}

GgufValue make(GgufType t, auto payload) {
  GgufValue v;
  v.type = t;
  v.v = std::move(payload);
  return v;
}

// Writes all of `data` at the current file position, retrying short writes.
Status write_all(int fd, const std::byte* data, uint64_t n, const std::string& path) {
  while (n > 0) {
    const ssize_t w = ::write(fd, data, std::min<uint64_t>(n, 1u << 30));
    if (w < 0) {
      if (errno == EINTR) continue;
      return Status::errorf("writing '{}': {}", path, std::strerror(errno));
    }
    data += w;
    n -= static_cast<uint64_t>(w);
  }
  return Status::ok();
}

}  // namespace

GgufWriter::GgufWriter(uint32_t alignment) : alignment_(alignment) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
    note_error(Status::errorf("GGUF writer: alignment {} is not a power of two", alignment));
    alignment_ = 32;
  } else if (alignment != 32) {
    set_u32("general.alignment", alignment);
  }
}

void GgufWriter::note_error(Status s) {
  if (error_.is_ok()) error_ = std::move(s);
}

void GgufWriter::set(const std::string& key, GgufValue value) {
  if (key.empty()) return note_error(Status::error("GGUF writer: empty metadata key"));
  if (Status s = check_value(value, key, 0); !s) return note_error(s);
  if (key == "general.alignment") {
    // The layout follows the declared alignment, so the two can never disagree.
    auto al = gguf_convert<uint32_t>(value, key);
    if (!al || *al == 0 || (*al & (*al - 1)) != 0)
      return note_error(
          Status::errorf("GGUF writer: general.alignment must be a power of two "
                         "that fits u32"));
    alignment_ = *al;
  }
  for (GgufKV& kv : kvs_) {
    if (kv.key == key) {
      kv.value = std::move(value);
      return;
    }
  }
  kvs_.push_back({key, std::move(value)});
}

void GgufWriter::set_u32(const std::string& key, uint32_t v) {
  set(key, make(GgufType::UINT32, uint64_t{v}));
}
void GgufWriter::set_i32(const std::string& key, int32_t v) {
  set(key, make(GgufType::INT32, int64_t{v}));
}
void GgufWriter::set_u64(const std::string& key, uint64_t v) {
  set(key, make(GgufType::UINT64, v));
}
void GgufWriter::set_f32(const std::string& key, float v) {
  set(key, make(GgufType::FLOAT32, double{v}));
}
void GgufWriter::set_bool(const std::string& key, bool v) { set(key, make(GgufType::BOOL, v)); }
void GgufWriter::set_str(const std::string& key, std::string v) {
  set(key, make(GgufType::STRING, std::move(v)));
}
void GgufWriter::set_str_array(const std::string& key, std::vector<std::string> v) {
  GgufArray a;
  a.elem_type = GgufType::STRING;
  a.items.reserve(v.size());
  for (std::string& s : v) a.items.push_back(make(GgufType::STRING, std::move(s)));
  set(key, make(GgufType::ARRAY, std::move(a)));
}
void GgufWriter::set_f32_array(const std::string& key, const std::vector<float>& v) {
  GgufArray a;
  a.elem_type = GgufType::FLOAT32;
  a.items.reserve(v.size());
  for (float f : v) a.items.push_back(make(GgufType::FLOAT32, double{f}));
  set(key, make(GgufType::ARRAY, std::move(a)));
}
void GgufWriter::set_i32_array(const std::string& key, const std::vector<int32_t>& v) {
  GgufArray a;
  a.elem_type = GgufType::INT32;
  a.items.reserve(v.size());
  for (int32_t x : v) a.items.push_back(make(GgufType::INT32, int64_t{x}));
  set(key, make(GgufType::ARRAY, std::move(a)));
}

void GgufWriter::remove(const std::string& key) {
  std::erase_if(kvs_, [&](const GgufKV& kv) { return kv.key == key; });
  if (key == "general.alignment") alignment_ = 32;
}

void GgufWriter::copy_metadata(const GgufFile& src) {
  for (const GgufKV& kv : src.metadata()) set(kv.key, kv.value);
}

Status GgufWriter::check_tensor(const std::string& name, DType dtype,
                                const std::vector<int64_t>& ne, uint64_t& n_bytes) const {
  if (name.empty() || name.size() > kMaxTensorName)
    return Status::errorf("GGUF writer: tensor name '{}' must be 1..{} bytes", name,
                          kMaxTensorName);
  for (const Tensor& t : tensors_)
    if (t.name == name) return Status::errorf("GGUF writer: duplicate tensor '{}'", name);
  auto tr = dtype_traits(static_cast<uint32_t>(dtype));
  if (!tr)
    return Status::errorf("GGUF writer: tensor '{}': unknown dtype {}", name,
                          static_cast<uint32_t>(dtype));
  if (ne.empty() || ne.size() > static_cast<size_t>(kMaxDims))
    return Status::errorf("GGUF writer: tensor '{}' has {} dims (must be 1..{})", name, ne.size(),
                          kMaxDims);
  uint64_t n_el = 1;
  for (size_t d = 0; d < ne.size(); ++d) {
    if (ne[d] < 1)
      return Status::errorf("GGUF writer: tensor '{}': dimension {} is {}", name, d, ne[d]);
    if (__builtin_mul_overflow(n_el, static_cast<uint64_t>(ne[d]), &n_el) ||
        n_el > static_cast<uint64_t>(INT64_MAX))
      return Status::errorf("GGUF writer: tensor '{}': element count overflows", name);
  }
  if (ne[0] % tr->block_size != 0)
    return Status::errorf(
        "GGUF writer: tensor '{}': row length {} is not a multiple of the {} "
        "block size {}",
        name, ne[0], tr->name, tr->block_size);
  if (__builtin_mul_overflow(n_el / tr->block_size, uint64_t{tr->type_size}, &n_bytes))
    return Status::errorf("GGUF writer: tensor '{}': byte size overflows", name);
  return Status::ok();
}

void GgufWriter::add_tensor(const std::string& name, DType dtype, std::vector<int64_t> ne,
                            std::span<const std::byte> data) {
  uint64_t n_bytes = 0;
  if (Status s = check_tensor(name, dtype, ne, n_bytes); !s) return note_error(s);
  if (data.size() != n_bytes)
    return note_error(Status::errorf("GGUF writer: tensor '{}' needs {} bytes, got {}", name,
                                     n_bytes, data.size()));
  tensors_.push_back(Tensor{name, dtype, std::move(ne), n_bytes, data, nullptr, false});
}

void GgufWriter::add_tensor_produced(const std::string& name, DType dtype, std::vector<int64_t> ne,
                                     Producer produce) {
  uint64_t n_bytes = 0;
  if (Status s = check_tensor(name, dtype, ne, n_bytes); !s) return note_error(s);
  if (!produce) return note_error(Status::errorf("GGUF writer: tensor '{}': no producer", name));
  tensors_.push_back(Tensor{name, dtype, std::move(ne), n_bytes, {}, std::move(produce), false});
}

void GgufWriter::add_tensor_zeros(const std::string& name, DType dtype, std::vector<int64_t> ne) {
  uint64_t n_bytes = 0;
  if (Status s = check_tensor(name, dtype, ne, n_bytes); !s) return note_error(s);
  tensors_.push_back(Tensor{name, dtype, std::move(ne), n_bytes, {}, nullptr, true});
}

std::vector<uint64_t> GgufWriter::layout(uint64_t& data_bytes) const {
  std::vector<uint64_t> offsets;
  offsets.reserve(tensors_.size());
  uint64_t off = 0;
  for (const Tensor& t : tensors_) {
    off = round_up(off, alignment_);
    offsets.push_back(off);
    off += t.n_bytes;
  }
  data_bytes = off;
  return offsets;
}

std::vector<std::byte> GgufWriter::header() const {
  uint64_t data_bytes = 0;
  const std::vector<uint64_t> offsets = layout(data_bytes);
  std::vector<std::byte> out;
  Sink s(out);
  s.raw<uint32_t>(kMagic);
  s.raw<uint32_t>(kVersion);
  s.raw<uint64_t>(tensors_.size());
  s.raw<uint64_t>(kvs_.size());
  for (const GgufKV& kv : kvs_) {
    s.str(kv.key);
    s.raw<uint32_t>(static_cast<uint32_t>(kv.value.type));
    put_value(s, kv.value);
  }
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const Tensor& t = tensors_[i];
    s.str(t.name);
    s.raw<uint32_t>(static_cast<uint32_t>(t.ne.size()));
    for (int64_t d : t.ne) s.raw<int64_t>(d);
    s.raw<uint32_t>(static_cast<uint32_t>(t.dtype));
    s.raw<uint64_t>(offsets[i]);
  }
  s.pad_to(alignment_);
  return out;
}

uint64_t GgufWriter::file_size() const {
  uint64_t data_bytes = 0;
  layout(data_bytes);
  return header().size() + data_bytes;
}

Status GgufWriter::write(const std::string& path) const {
  KILN_TRY(error_);
  // Written beside the target and renamed at the end, so a failure never leaves a
  // half-written file under the final name.
  const std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Status::errorf("cannot create '{}': {}", tmp, std::strerror(errno));
  auto fail = [&](Status s) {
    ::close(fd);
    ::unlink(tmp.c_str());
    return s;
  };
  const std::vector<std::byte> head = header();
  if (Status s = write_all(fd, head.data(), head.size(), tmp); !s) return fail(s);
  uint64_t data_bytes = 0;
  const std::vector<uint64_t> offsets = layout(data_bytes);
  const uint64_t total = head.size() + data_bytes;
  std::vector<std::byte> scratch;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const Tensor& t = tensors_[i];
    const off_t at = static_cast<off_t>(head.size() + offsets[i]);
    // Seeking (instead of writing padding or zeros) leaves holes: zero tensors cost no disk.
    if (::lseek(fd, at, SEEK_SET) != at)
      return fail(Status::errorf("seeking in '{}': {}", tmp, std::strerror(errno)));
    if (t.zeros) continue;
    std::span<const std::byte> bytes = t.data;
    if (t.produce) {
      scratch.assign(t.n_bytes, std::byte{0});
      if (Status s = t.produce(scratch); !s)
        return fail(s.context(fmt::format("producing tensor '{}'", t.name)));
      bytes = scratch;
    }
    if (Status s = write_all(fd, bytes.data(), bytes.size(), tmp); !s) return fail(s);
  }
  if (::ftruncate(fd, static_cast<off_t>(total)) != 0)
    return fail(Status::errorf("sizing '{}': {}", tmp, std::strerror(errno)));
  if (::close(fd) != 0) {
    ::unlink(tmp.c_str());
    return Status::errorf("closing '{}': {}", tmp, std::strerror(errno));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int e = errno;
    ::unlink(tmp.c_str());
    return Status::errorf("renaming '{}' to '{}': {}", tmp, path, std::strerror(e));
  }
  return Status::ok();
}

Expected<std::vector<std::byte>> GgufWriter::to_bytes() const {
  KILN_TRY(error_);
  std::vector<std::byte> out = header();
  const uint64_t head = out.size();
  uint64_t data_bytes = 0;
  const std::vector<uint64_t> offsets = layout(data_bytes);
  out.resize(head + data_bytes, std::byte{0});
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const Tensor& t = tensors_[i];
    std::span<std::byte> dst(out.data() + head + offsets[i], t.n_bytes);
    if (t.zeros) continue;
    if (t.produce) {
      if (Status s = t.produce(dst); !s)
        return s.context(fmt::format("producing tensor '{}'", t.name));
    } else {
      std::memcpy(dst.data(), t.data.data(), t.n_bytes);
    }
  }
  return out;
}

std::vector<std::byte> GgufWriter::write_to_memory() const {
  auto r = to_bytes();
  KILN_CHECK(r.has_value(), "GgufWriter::write_to_memory: {}", r.error());
  return std::move(*r);
}

}  // namespace kiln
