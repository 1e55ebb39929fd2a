// quant/quant.cpp: quant.h's dispatch by dtype, plus the float formats (F32 F16 BF16), whose
// "quantization" is a rounding conversion and whose dot products accumulate in double as
// ggml's scalar ggml_vec_dot_f32/f16 do.
#include "quant/quant.h"

#include <cstring>
#include <vector>

#include "core/half.h"
#include "quant/detail.h"

namespace kiln::quant {
namespace {

using detail::Bytes;

void check_row(DType t, size_t n_elems, size_t n_bytes, const char* what) {
  const auto rb = row_bytes(t, n_elems);
  KILN_CHECK(rb.has_value(), "{}: {} elements is not a whole number of {} blocks", what, n_elems,
             dtype_name(t));
  KILN_CHECK(*rb == n_bytes, "{}: {} row of {} elements needs {} bytes, got {}", what,
             dtype_name(t), n_elems, *rb, n_bytes);
}

}  // namespace

bool can_dequantize(DType t) {
  switch (t) {
    case DType::F32: case DType::F16: case DType::BF16:
    case DType::Q4_0: case DType::Q4_1: case DType::Q5_0: case DType::Q5_1:
    case DType::Q8_0: case DType::Q8_1:
    case DType::Q2_K: case DType::Q3_K: case DType::Q4_K: case DType::Q5_K: case DType::Q6_K:
    case DType::Q8_K:
      return true;
    default:
      return false;
  }
}

bool can_quantize(DType t) { return can_dequantize(t); }

void dequantize_row(DType t, std::span<const std::byte> src, std::span<float> dst) {
  check_row(t, dst.size(), src.size(), "dequantize_row");
  switch (t) {
    case DType::F32:
      std::memcpy(dst.data(), src.data(), src.size());
      return;
    case DType::F16:
      for (size_t i = 0; i < dst.size(); ++i)
        dst[i] = f16_to_f32(detail::load_block<f16>(src, static_cast<int64_t>(i)));
      return;
    case DType::BF16:
      for (size_t i = 0; i < dst.size(); ++i)
        dst[i] = bf16_to_f32(detail::load_block<bf16>(src, static_cast<int64_t>(i)));
      return;
    case DType::Q4_0: return detail::dequantize_q4_0(src, dst);
    case DType::Q4_1: return detail::dequantize_q4_1(src, dst);
    case DType::Q5_0: return detail::dequantize_q5_0(src, dst);
    case DType::Q5_1: return detail::dequantize_q5_1(src, dst);
    case DType::Q8_0: return detail::dequantize_q8_0(src, dst);
    case DType::Q8_1: return detail::dequantize_q8_1(src, dst);
    case DType::Q2_K: return detail::dequantize_q2_K(src, dst);
    case DType::Q3_K: return detail::dequantize_q3_K(src, dst);
    case DType::Q4_K: return detail::dequantize_q4_K(src, dst);
    case DType::Q5_K: return detail::dequantize_q5_K(src, dst);
    case DType::Q6_K: return detail::dequantize_q6_K(src, dst);
    case DType::Q8_K: return detail::dequantize_q8_K(src, dst);
    default:
      KILN_CHECK(false, "dequantize_row: no decoder for {}", dtype_name(t));
  }
}

void quantize_row(DType t, std::span<const float> src, std::span<std::byte> dst,
                  std::span<const float> importance) {
  check_row(t, src.size(), dst.size(), "quantize_row");
  // llama.cpp's imatrix searches (quantize_row_*_impl) are not ported yet; refusing beats
  // silently producing the plain reference encoding for a caller that asked for weighting.
  KILN_CHECK(importance.empty(), "quantize_row: importance weights are not supported yet");
  switch (t) {
    case DType::F32:
      std::memcpy(dst.data(), src.data(), dst.size());
      return;
    case DType::F16:
      for (size_t i = 0; i < src.size(); ++i)
        detail::store_block(dst, static_cast<int64_t>(i), f32_to_f16(src[i]));
      return;
    case DType::BF16:
      for (size_t i = 0; i < src.size(); ++i)
        detail::store_block(dst, static_cast<int64_t>(i), f32_to_bf16(src[i]));
      return;
    case DType::Q4_0: return detail::quantize_q4_0(src, dst);
    case DType::Q4_1: return detail::quantize_q4_1(src, dst);
    case DType::Q5_0: return detail::quantize_q5_0(src, dst);
    case DType::Q5_1: return detail::quantize_q5_1(src, dst);
    case DType::Q8_0: return detail::quantize_q8_0(src, dst);
    case DType::Q8_1: return detail::quantize_q8_1(src, dst);
    case DType::Q2_K: return detail::quantize_q2_K(src, dst);
    case DType::Q3_K: return detail::quantize_q3_K(src, dst);
    case DType::Q4_K: return detail::quantize_q4_K(src, dst);
    case DType::Q5_K: return detail::quantize_q5_K(src, dst);
    case DType::Q6_K: return detail::quantize_q6_K(src, dst);
    case DType::Q8_K: return detail::quantize_q8_K(src, dst);
    default:
      KILN_CHECK(false, "quantize_row: no encoder for {}", dtype_name(t));
  }
}

DType vec_dot_type(DType t) {
  switch (t) {
    case DType::Q4_0: case DType::Q5_0: case DType::Q8_0:
      return DType::Q8_0;
    case DType::Q4_1: case DType::Q5_1:
      return DType::Q8_1;
    case DType::Q2_K: case DType::Q3_K: case DType::Q4_K: case DType::Q5_K: case DType::Q6_K:
      return DType::Q8_K;
    default:
      return DType::F32;
  }
}

float vec_dot(DType t, int64_t n, std::span<const std::byte> w, std::span<const std::byte> act) {
  KILN_CHECK(n >= 0, "vec_dot: negative length {}", n);
  check_row(t, static_cast<size_t>(n), w.size(), "vec_dot weights");
  const DType at = vec_dot_type(t);
  check_row(at, static_cast<size_t>(n), act.size(), "vec_dot activations");
  switch (t) {
    case DType::Q4_0: return detail::dot_q4_0_q8_0(n, w, act);
    case DType::Q4_1: return detail::dot_q4_1_q8_1(n, w, act);
    case DType::Q5_0: return detail::dot_q5_0_q8_0(n, w, act);
    case DType::Q5_1: return detail::dot_q5_1_q8_1(n, w, act);
    case DType::Q8_0: return detail::dot_q8_0_q8_0(n, w, act);
    case DType::Q2_K: return detail::dot_q2_K_q8_K(n, w, act);
    case DType::Q3_K: return detail::dot_q3_K_q8_K(n, w, act);
    case DType::Q4_K: return detail::dot_q4_K_q8_K(n, w, act);
    case DType::Q5_K: return detail::dot_q5_K_q8_K(n, w, act);
    case DType::Q6_K: return detail::dot_q6_K_q8_K(n, w, act);
    default:
      break;
  }
  KILN_CHECK(can_dequantize(t), "vec_dot: unsupported weight type {}", dtype_name(t));
  // Float weights (and the activation formats, if ever used as weights) against f32:
  // decode, then accumulate in double like ggml's scalar float dots.
  std::vector<float> wf(static_cast<size_t>(n));
  dequantize_row(t, w, wf);
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) {
    float a;
    std::memcpy(&a, act.data() + i * sizeof(float), sizeof(float));
    sum += static_cast<double>(wf[static_cast<size_t>(i)]) * static_cast<double>(a);
  }
  return static_cast<float>(sum);
}

}  // namespace kiln::quant
