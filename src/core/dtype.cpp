// core/dtype.cpp: the ggml type table (block sizes and byte sizes from ggml's type_traits).
#include "core/dtype.h"

#include <array>
#include <cctype>

#include "core/check.h"

namespace kiln {
namespace {

struct Row {
  uint32_t id;
  DTypeTraits t;
};

constexpr std::array kTable = {
    Row{0, {"f32", 1, 4}},         Row{1, {"f16", 1, 2}},         Row{2, {"q4_0", 32, 18}},
    Row{3, {"q4_1", 32, 20}},      Row{6, {"q5_0", 32, 22}},      Row{7, {"q5_1", 32, 24}},
    Row{8, {"q8_0", 32, 34}},      Row{9, {"q8_1", 32, 36}},      Row{10, {"q2_K", 256, 84}},
    Row{11, {"q3_K", 256, 110}},   Row{12, {"q4_K", 256, 144}},   Row{13, {"q5_K", 256, 176}},
    Row{14, {"q6_K", 256, 210}},   Row{15, {"q8_K", 256, 292}},   Row{16, {"iq2_xxs", 256, 66}},
    Row{17, {"iq2_xs", 256, 74}},  Row{18, {"iq3_xxs", 256, 98}}, Row{19, {"iq1_s", 256, 50}},
    Row{20, {"iq4_nl", 32, 18}},   Row{21, {"iq3_s", 256, 110}},  Row{22, {"iq2_s", 256, 82}},
    Row{23, {"iq4_xs", 256, 136}}, Row{24, {"i8", 1, 1}},         Row{25, {"i16", 1, 2}},
    Row{26, {"i32", 1, 4}},        Row{27, {"i64", 1, 8}},        Row{28, {"f64", 1, 8}},
    Row{29, {"iq1_m", 256, 56}},   Row{30, {"bf16", 1, 2}},       Row{34, {"tq1_0", 256, 54}},
    Row{35, {"tq2_0", 256, 66}},   Row{39, {"mxfp4", 32, 17}},
};

}  // namespace

std::optional<DTypeTraits> dtype_traits(uint32_t raw) {
  for (const Row& r : kTable)
    if (r.id == raw) return r.t;
  return std::nullopt;
}

DTypeTraits traits(DType t) {
  auto tr = dtype_traits(static_cast<uint32_t>(t));
  KILN_CHECK(tr.has_value(), "unknown dtype id {}", static_cast<uint32_t>(t));
  return *tr;
}

std::string_view dtype_name(DType t) { return traits(t).name; }

bool type_names_equal(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::tolower(static_cast<unsigned char>(a[i])) !=
        std::tolower(static_cast<unsigned char>(b[i])))
      return false;
  return true;
}

std::optional<DType> dtype_from_name(std::string_view name) {
  for (const Row& r : kTable)
    if (type_names_equal(r.t.name, name)) return static_cast<DType>(r.id);
  return std::nullopt;
}

std::optional<uint64_t> row_bytes(DType t, uint64_t n) {
  const DTypeTraits tr = traits(t);
  if (n % tr.block_size != 0) return std::nullopt;
  return n / tr.block_size * tr.type_size;
}

}  // namespace kiln
