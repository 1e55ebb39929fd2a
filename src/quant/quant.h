// quant/quant.h: llama.cpp's block formats, bit-exact: layout, reference (scalar)
// dequantize/quantize, and reference dot products. This is the oracle for every SIMD or GPU
// kernel that reads quantized weights.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "core/dtype.h"
#include "core/status.h"

namespace kiln::quant {

// True if dequantize_row / vec_dot support `t` (F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1
// Q2_K Q3_K Q4_K Q5_K Q6_K MXFP4, plus the activation types Q8_1 / Q8_K).
bool can_dequantize(DType t);
// True if quantize_row can produce `t`.
bool can_quantize(DType t);

// Decodes one row: src holds exactly row_bytes(t, dst.size()) bytes; dst.size() must be a
// multiple of the block size (violations are invariant failures: callers pass views that
// GgufFile already validated).
void dequantize_row(DType t, std::span<const std::byte> src, std::span<float> dst);

// Encodes one row of src.size() elements into dst (row_bytes(t, n) bytes), deterministically,
// with llama.cpp's reference algorithm (so Q8_0/Q4_0 output equals llama.cpp's byte for byte).
// `importance` (optional, src.size() weights) is the imatrix llama.cpp's K-quant search uses.
void quantize_row(DType t, std::span<const float> src, std::span<std::byte> dst,
                  std::span<const float> importance = {});

// The activation block type that weights of type `t` are dotted against
// (Q8_0 for Q4_0/Q5_0/Q8_0, Q8_1 for Q4_1/Q5_1, Q8_K for K-quants, F32 otherwise).
DType vec_dot_type(DType t);

// Reference dot product of one weight row (type t, n elements) with one activation row
// already encoded as vec_dot_type(t). Result in f32, computed as llama.cpp's scalar path.
float vec_dot(DType t, int64_t n, std::span<const std::byte> w, std::span<const std::byte> act);

}  // namespace kiln::quant
