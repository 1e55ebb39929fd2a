// quant/convert.h: re-encoding whole tensors from one dtype to another (decode each row to
// f32, encode with the reference quantizer), split over threads by rows. Used by
// `kiln quantize` and by the tests that compare our files with llama.cpp's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "core/dtype.h"
#include "core/status.h"

namespace kiln::quant {

// Converts n_rows rows of row_len elements stored as `from` in src into `to` in dst. Same
// type: a plain copy. Errors (never aborts) on sizes that do not fit the types, on a type
// the quant layer cannot read or write, and on non-finite input values, naming the row.
Status convert_rows(DType from, DType to, int64_t row_len, int64_t n_rows,
                    std::span<const std::byte> src, std::span<std::byte> dst, int n_threads = 1);

}  // namespace kiln::quant
