// format/gguf_writer.h: writes GGUF v3 files (metadata + tensor index + aligned data). Used by
// tests (crafted and random models), `kiln quantize` and `kiln mkmodel`.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/status.h"
#include "format/gguf.h"

namespace kiln {

class GgufWriter {
 public:
  // An alignment other than 32 is recorded as general.alignment (so readers agree).
  explicit GgufWriter(uint32_t alignment = 32);

  // Metadata, written in insertion order; setting an existing key replaces its value in place.
  void set(const std::string& key, GgufValue value);
  void set_u32(const std::string& key, uint32_t v);
  void set_i32(const std::string& key, int32_t v);
  void set_u64(const std::string& key, uint64_t v);
  void set_f32(const std::string& key, float v);
  void set_bool(const std::string& key, bool v);
  void set_str(const std::string& key, std::string v);
  void set_str_array(const std::string& key, std::vector<std::string> v);
  void set_f32_array(const std::string& key, const std::vector<float>& v);
  void set_i32_array(const std::string& key, const std::vector<int32_t>& v);
  void remove(const std::string& key);
  // Copies every metadata pair of `src` (its general.alignment included).
  void copy_metadata(const GgufFile& src);

  // A tensor whose bytes are borrowed until write(): `data` must be exactly
  // row_bytes(dtype, ne[0]) * rows bytes. `ne` is in ggml order (ne[0] = row length).
  void add_tensor(const std::string& name, DType dtype, std::vector<int64_t> ne,
                  std::span<const std::byte> data);
  // A tensor whose bytes are produced at write time, row block by row block, into `out`
  // (exactly the tensor's byte size); lets quantize/mkmodel stream multi-GB files.
  using Producer = std::function<Status(std::span<std::byte> out)>;
  void add_tensor_produced(const std::string& name, DType dtype, std::vector<int64_t> ne,
                           Producer produce);
  // A tensor left as a hole of zeros (sparse on disk where the filesystem allows).
  void add_tensor_zeros(const std::string& name, DType dtype, std::vector<int64_t> ne);

  // Errors in what was added (bad shape, wrong byte count, mistyped value, duplicate tensor)
  // are remembered, and the first is returned by write()/to_bytes(); status() shows it early.
  const Status& status() const { return error_; }

  // Writes beside `path` and renames into place; tensors added with add_tensor_zeros become
  // holes (sparse) on filesystems that support them.
  Status write(const std::string& path) const;
  Expected<std::vector<std::byte>> to_bytes() const;
  // Like to_bytes() for tests that build valid files: aborts (KILN_CHECK) on a recorded error.
  std::vector<std::byte> write_to_memory() const;
  // Bytes the header (with padding to the alignment) and the whole file will take.
  std::vector<std::byte> header() const;
  uint64_t file_size() const;
  uint32_t alignment() const { return alignment_; }

 private:
  struct Tensor {
    std::string name;
    DType dtype;
    std::vector<int64_t> ne;
    uint64_t n_bytes;
    std::span<const std::byte> data;
    Producer produce;
    bool zeros = false;
  };
  void note_error(Status s);
  Status check_tensor(const std::string& name, DType dtype, const std::vector<int64_t>& ne,
                      uint64_t& n_bytes) const;
  // Offsets of each tensor from the start of the data section; data_bytes = section size.
  std::vector<uint64_t> layout(uint64_t& data_bytes) const;

  uint32_t alignment_;
  std::vector<GgufKV> kvs_;
  std::vector<Tensor> tensors_;
  Status error_;
};

}  // namespace kiln
