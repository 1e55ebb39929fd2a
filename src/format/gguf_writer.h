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

  Status write(const std::string& path) const;
  std::vector<std::byte> write_to_memory() const;

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
  uint32_t alignment_;
  std::vector<GgufKV> kvs_;
  std::vector<Tensor> tensors_;
};

}  // namespace kiln
