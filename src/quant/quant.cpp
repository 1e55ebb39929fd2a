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
using detail::MutBytes;
using detail::RowCodec;

void check_row(DType t, size_t n_elems, size_t n_bytes, const char* what) {
  const auto rb = row_bytes(t, n_elems);
  KILN_CHECK(rb.has_value(), "{}: {} elements is not a whole number of {} blocks", what, n_elems,
             dtype_name(t));
  KILN_CHECK(*rb == n_bytes, "{}: {} row of {} elements needs {} bytes, got {}", what,
             dtype_name(t), n_elems, *rb, n_bytes);
}

void copy_from_f32(Bytes src, std::span<float> dst) {
  std::memcpy(dst.data(), src.data(), src.size());
}
void copy_to_f32(std::span<const float> src, MutBytes dst) {
  std::memcpy(dst.data(), src.data(), dst.size());
}
template <typename Half, float (*kToF32)(Half)>
void decode_halves(Bytes src, std::span<float> dst) {
  for (size_t i = 0; i < dst.size(); ++i)
    dst[i] = kToF32(detail::load_block<Half>(src, static_cast<int64_t>(i)));
}
template <typename Half, Half (*kFromF32)(float)>
void encode_halves(std::span<const float> src, MutBytes dst) {
  for (size_t i = 0; i < src.size(); ++i)
    detail::store_block(dst, static_cast<int64_t>(i), kFromF32(src[i]));
}

constexpr RowCodec kFloatCodecs[] = {
    {DType::F32, DType::F32, copy_from_f32, copy_to_f32, nullptr},
    {DType::F16, DType::F32, decode_halves<f16, f16_to_f32>, encode_halves<f16, f32_to_f16>,
     nullptr},
    {DType::BF16, DType::F32, decode_halves<bf16, bf16_to_f32>, encode_halves<bf16, f32_to_bf16>,
     nullptr},
};

// The one place that knows which types have reference row functions; null for the others.
const RowCodec* find_codec(DType t) {
  const std::span<const RowCodec> families[] = {kFloatCodecs, detail::legacy_codecs(),
                                                detail::kquant_codecs(), detail::iquant_codecs(),
                                                detail::mxfp4_codecs()};
  for (std::span<const RowCodec> family : families)
    for (const RowCodec& c : family)
      if (c.type == t) return &c;
  return nullptr;
}

}  // namespace

bool can_dequantize(DType t) { return find_codec(t) != nullptr; }

bool can_quantize(DType t) { return can_dequantize(t); }

void dequantize_row(DType t, std::span<const std::byte> src, std::span<float> dst) {
  check_row(t, dst.size(), src.size(), "dequantize_row");
  const RowCodec* c = find_codec(t);
  KILN_CHECK(c != nullptr, "dequantize_row: no decoder for {}", dtype_name(t));
  c->dequantize(src, dst);
}

void quantize_row(DType t, std::span<const float> src, std::span<std::byte> dst,
                  std::span<const float> importance) {
  check_row(t, src.size(), dst.size(), "quantize_row");
  // llama.cpp's imatrix searches (quantize_row_*_impl) are not ported yet; refusing beats
  // silently producing the plain reference encoding for a caller that asked for weighting.
  KILN_CHECK(importance.empty(), "quantize_row: importance weights are not supported yet");
  const RowCodec* c = find_codec(t);
  KILN_CHECK(c != nullptr, "quantize_row: no encoder for {}", dtype_name(t));
  c->quantize(src, dst);
}

DType vec_dot_type(DType t) {
  const RowCodec* c = find_codec(t);
  return c != nullptr ? c->dot_type : DType::F32;
}

float vec_dot(DType t, int64_t n, std::span<const std::byte> w, std::span<const std::byte> act) {
  KILN_CHECK(n >= 0, "vec_dot: negative length {}", n);
  check_row(t, static_cast<size_t>(n), w.size(), "vec_dot weights");
  const DType at = vec_dot_type(t);
  check_row(at, static_cast<size_t>(n), act.size(), "vec_dot activations");
  const RowCodec* c = find_codec(t);
  if (c != nullptr && c->dot != nullptr) return c->dot(n, w, act);
  KILN_CHECK(c != nullptr, "vec_dot: unsupported weight type {}", dtype_name(t));
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
