// tests/quant/quantize_cmd_test.cpp: runs the `kiln quantize` binary on the shared models and
// checks its files against llama.cpp's: per-tensor types, metadata, tensor bytes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>

#include "common/testdata.h"
#include "format/gguf.h"
#include "core/half.h"
#include "quant/blocks.h"
#include "quant/quant.h"

namespace kiln::quant {
namespace {

struct RunResult {
  int exit_code;
  std::string stderr_text;
};

RunResult run_kiln(const std::string& args, const std::string& dir) {
  const std::string err = dir + "/stderr.txt";
  const std::string cmd = testing::kiln_binary() + " " + args + " 2> " + err;
  const int rc = std::system(cmd.c_str());
  return {WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, testing::read_file(err)};
}

GgufFile open_file(const std::string& path) {
  auto g = GgufFile::open(path);
  EXPECT_TRUE(g.has_value()) << g.error();
  if (!g) std::abort();
  return std::move(*g);
}

bool same_value(const GgufValue& a, const GgufValue& b) {
  if (a.type != b.type || a.v.index() != b.v.index()) return false;
  if (!a.is_array()) {
    if (a.is_string()) return a.str() == b.str();
    if (std::holds_alternative<uint64_t>(a.v))
      return std::get<uint64_t>(a.v) == std::get<uint64_t>(b.v);
    if (std::holds_alternative<int64_t>(a.v))
      return std::get<int64_t>(a.v) == std::get<int64_t>(b.v);
    if (std::holds_alternative<bool>(a.v)) return std::get<bool>(a.v) == std::get<bool>(b.v);
    return std::get<double>(a.v) == std::get<double>(b.v);
  }
  const GgufArray &x = a.arr(), &y = b.arr();
  if (x.elem_type != y.elem_type || x.items.size() != y.items.size()) return false;
  for (size_t i = 0; i < x.items.size(); ++i)
    if (!same_value(x.items[i], y.items[i])) return false;
  return true;
}

// Same keys, same order, same values: quantize must carry every metadata pair over and
// only change general.file_type the way llama.cpp does.
void expect_same_metadata(const GgufFile& ours, const GgufFile& ref) {
  ASSERT_EQ(ours.metadata().size(), ref.metadata().size());
  for (size_t i = 0; i < ref.metadata().size(); ++i) {
    const GgufKV& a = ours.metadata()[i];
    const GgufKV& b = ref.metadata()[i];
    EXPECT_EQ(a.key, b.key) << i;
    EXPECT_EQ(a.value.type, b.value.type) << a.key;
    EXPECT_TRUE(same_value(a.value, b.value)) << a.key;
  }
}

double rel_rms(const GgufFile& g, const GgufFile& f16) {
  double e2 = 0, r2 = 0;
  for (const TensorInfo& t : g.tensors()) {
    const TensorInfo* r = f16.find_tensor(t.name);
    const auto n = static_cast<size_t>(t.ne[0]);
    std::vector<float> a(n), b(n);
    for (int64_t row = 0; row < t.n_rows(); ++row) {
      dequantize_row(t.dtype, g.view(t).row(row), a);
      dequantize_row(r->dtype, f16.view(*r).row(row), b);
      for (size_t i = 0; i < n; ++i) {
        e2 += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
        r2 += double(b[i]) * b[i];
      }
    }
  }
  return std::sqrt(e2 / r2);
}

TEST(QuantizeCommand, Q8_0OfF32ModelEqualsLlamaCppFile) {
  const std::string dir = testing::temp_dir();
  const std::string out = dir + "/stories-q8_0.gguf";
  const auto r = run_kiln(
      fmt::format("quantize {} {} Q8_0 --threads 2", testing::model_path("stories260K.gguf"), out),
      dir);
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  EXPECT_NE(r.stderr_text.find("48/48"), std::string::npos) << r.stderr_text;  // progress
  const GgufFile ours = open_file(out);
  const GgufFile ref = open_file(testing::model_path("stories260K-q8_0.gguf"));
  expect_same_metadata(ours, ref);
  ASSERT_EQ(ours.tensors().size(), ref.tensors().size());
  for (const TensorInfo& t : ref.tensors()) {
    const TensorInfo* o = ours.find_tensor(t.name);
    ASSERT_NE(o, nullptr) << t.name;
    EXPECT_EQ(dtype_name(o->dtype), dtype_name(t.dtype)) << t.name;
    const auto a = ours.view(*o).bytes, b = ref.view(t).bytes;
    ASSERT_EQ(a.size(), b.size()) << t.name;
    EXPECT_TRUE(std::equal(a.begin(), a.end(), b.begin())) << t.name;
  }
  // The whole file too (header, metadata, tensor order, offsets). llama.cpp also pads the
  // last tensor to the alignment; GgufWriter ends the file after it, so allow only zeros
  // beyond our end.
  const std::string mine = testing::read_file(out);
  const std::string theirs = testing::read_file(testing::model_path("stories260K-q8_0.gguf"));
  ASSERT_LE(mine.size(), theirs.size());
  EXPECT_LT(theirs.size() - mine.size(), 32u);
  EXPECT_TRUE(theirs.compare(0, mine.size(), mine) == 0) << "files differ before the end";
  for (size_t i = mine.size(); i < theirs.size(); ++i) EXPECT_EQ(theirs[i], '\0');
  std::filesystem::remove_all(dir);
}

TEST(QuantizeCommand, PresetsMatchLlamaCppMixes) {
  const std::string dir = testing::temp_dir();
  const GgufFile f16 = open_file(testing::model_path("llama-gqa-f16.gguf"));
  struct Case {
    const char* preset;
    const char* ref;
  };
  for (Case c : {Case{"Q4_K_M", "llama-gqa-q4_k_m.gguf"}, Case{"Q5_K_M", "llama-gqa-q5_k_m.gguf"},
                 Case{"Q6_K", "llama-gqa-q6_k.gguf"}, Case{"Q8_0", "llama-gqa-q8_0.gguf"},
                 Case{"Q4_0", "llama-gqa-q4_0.gguf"}, Case{"BF16", "llama-gqa-bf16.gguf"},
                 Case{"F16", "llama-gqa-f16.gguf"}}) {
    const std::string out = dir + "/" + c.preset + ".gguf";
    const auto r = run_kiln(fmt::format("quantize {} {} {} -t 2",
                                        testing::model_path("llama-gqa-f16.gguf"), out, c.preset),
                            dir);
    ASSERT_EQ(r.exit_code, 0) << c.preset << ": " << r.stderr_text;
    const GgufFile ours = open_file(out);
    const GgufFile ref = open_file(testing::model_path(c.ref));
    expect_same_metadata(ours, ref);
    ASSERT_EQ(ours.tensors().size(), ref.tensors().size());
    for (size_t i = 0; i < ref.tensors().size(); ++i) {
      const TensorInfo& t = ref.tensors()[i];
      EXPECT_EQ(ours.tensors()[i].name, t.name) << c.preset;  // order kept
      EXPECT_EQ(dtype_name(ours.tensors()[i].dtype), dtype_name(t.dtype))
          << c.preset << " " << t.name;
    }
    const double ours_err = rel_rms(ours, f16), ref_err = rel_rms(ref, f16);
    std::printf(
        "  %-6s file size %9ju (llama.cpp %9ju), relative RMS error vs f16 %.6f (llama.cpp %.6f)\n",
        c.preset, static_cast<uintmax_t>(ours.file_size()), static_cast<uintmax_t>(ref.file_size()),
        ours_err, ref_err);
    EXPECT_EQ(ours.file_size(), ref.file_size()) << c.preset;
    EXPECT_LE(ours_err, ref_err * 1.02 + 1e-9) << c.preset;
  }
  std::filesystem::remove_all(dir);
}

// FNV-1a 64 of a byte string.
uint64_t fnv1a(std::string_view bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char c : bytes) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ull;
  }
  return h;
}

// llama-quantize 0.7.0 (build 11669), run as `peer llama-quantize SOURCE OUT PRESET 2` on
// 2026-12-05: the size and FNV-1a 64 of each file it wrote, up to the end of its last tensor
// (beyond it llama.cpp pads with zeros to the 32-byte alignment, which GgufWriter does not write:
// 16 bytes for the stories260K files, none for llama-gqa's). From llama-gqa-f16 (f16 source) and
// stories260K (f32 source, 64-wide rows and a 172-column ffn_down, so the K-quants' fallbacks
// to Q4_0 / IQ4_NL / F16 are taken). The shipped llama-iq-* fixtures were quantized from f32
// weights we do not have, so their data bytes cannot be reproduced from the f16 file; their
// metadata and tensor types still must be.
struct PeerFile {
  const char* source;
  const char* preset;
  const char* fixture;  // the shipped file of the same preset, or null
  uint64_t bytes;
  uint64_t fnv;
};
constexpr PeerFile kPeerFiles[] = {
    {"llama-gqa-f16.gguf", "IQ4_NL", "llama-iq-iq4_nl.gguf", 1973888, 0xecbc3afbd1a4ab09ull},
    {"llama-gqa-f16.gguf", "IQ4_XS", "llama-iq-iq4_xs.gguf", 1871488, 0x7d1aba8b3bd25c20ull},
    {"llama-gqa-f16.gguf", "Q4_K_S", "llama-iq-q4_k_s.gguf", 1990272, 0x5a357457c7eac382ull},
    {"llama-gqa-f16.gguf", "Q3_K_M", "llama-iq-q3_k_m.gguf", 1703552, 0x16c4be8003988103ull},
    {"llama-gqa-f16.gguf", "Q2_K", "llama-iq-q2_k.gguf", 1325696, 0x338d2f86649b3fd0ull},
    {"stories260K.gguf", "IQ4_NL", nullptr, 277008, 0x18fe52b0c6183db3ull},
    {"stories260K.gguf", "IQ4_XS", nullptr, 277008, 0xfa3b2e2d567c77ccull},
    {"stories260K.gguf", "Q4_K_S", nullptr, 303056, 0xf0b01c3abf218c9dull},
    {"stories260K.gguf", "Q3_K_M", nullptr, 281104, 0x86fc3a4b9f13c67dull},
    {"stories260K.gguf", "Q2_K", nullptr, 277008, 0x60f3047bf9cc50dcull},
};

// kiln quantize writes llama-quantize's bytes for the i-quants and the K mixes, from the same
// input: every tensor type, the metadata, and every data byte.
TEST(QuantizeCommand, IQuantsAndKMixesAreLlamaQuantizeBytes) {
  const std::string dir = testing::temp_dir();
  for (const PeerFile& c : kPeerFiles) {
    const std::string out = dir + "/" + c.preset + ".gguf";
    const auto r = run_kiln(
        fmt::format("quantize {} {} {} -t 2", testing::model_path(c.source), out, c.preset), dir);
    ASSERT_EQ(r.exit_code, 0) << c.preset << ": " << r.stderr_text;
    const std::string mine = testing::read_file(out);
    EXPECT_EQ(mine.size(), c.bytes) << c.source << " " << c.preset;
    EXPECT_EQ(fnv1a(mine), c.fnv) << c.source << " " << c.preset << ": not llama-quantize's bytes";
    std::printf("  %-18s %-6s %7zu bytes, FNV-1a %016jx (llama-quantize %016jx)\n", c.source,
                c.preset, mine.size(), static_cast<uintmax_t>(fnv1a(mine)),
                static_cast<uintmax_t>(c.fnv));
    if (c.fixture == nullptr) continue;
    const GgufFile ours = open_file(out);
    const GgufFile ref = open_file(testing::model_path(c.fixture));
    // The fixture's metadata but its general.name ("llama-iq" vs the f16 file's).
    ASSERT_EQ(ours.metadata().size(), ref.metadata().size()) << c.preset;
    for (size_t i = 0; i < ref.metadata().size(); ++i) {
      const GgufKV &a = ours.metadata()[i], &b = ref.metadata()[i];
      EXPECT_EQ(a.key, b.key) << c.preset;
      if (b.key != "general.name") EXPECT_TRUE(same_value(a.value, b.value)) << c.preset << a.key;
    }
    ASSERT_EQ(ours.tensors().size(), ref.tensors().size()) << c.preset;
    for (size_t i = 0; i < ref.tensors().size(); ++i) {
      EXPECT_EQ(ours.tensors()[i].name, ref.tensors()[i].name) << c.preset;
      EXPECT_EQ(dtype_name(ours.tensors()[i].dtype), dtype_name(ref.tensors()[i].dtype))
          << c.preset << " " << ref.tensors()[i].name;
    }
  }
  std::filesystem::remove_all(dir);
}

// llama-quantize's MXFP4_MOE mix: the stacked expert tensors MXFP4, every other matrix Q8_0
// (output.weight too); routers, norms, sinks and biases copied.
// Byte identity: llama-quantize 0.7.0 run on gpt-oss-f16.gguf (`../shared/tools/peer
// llama-quantize gpt-oss-f16.gguf out.gguf MXFP4_MOE 2`) wrote a file of 1535552 bytes with
// FNV-1a 0x5ddaa1b3b24fed6e; kiln's file must be that file. (The shipped gpt-oss-mxfp4_moe.gguf
// was quantized from the f32 weights before their f16 rounding, so it agrees with ours only up
// to that rounding: the test below.)
TEST(QuantizeCommand, Mxfp4MoeOfGptOssEqualsLlamaQuantizeOutput) {
  const std::string dir = testing::temp_dir();
  const std::string out = dir + "/gpt-oss-mxfp4_moe.gguf";
  const auto r = run_kiln(
      fmt::format("quantize {} {} MXFP4_MOE -t 2", testing::model_path("gpt-oss-f16.gguf"), out),
      dir);
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  const std::string mine = testing::read_file(out);
  EXPECT_EQ(mine.size(), 1535552u);
  EXPECT_EQ(fnv1a(mine), 0x5ddaa1b3b24fed6eull) << std::hex << fnv1a(mine);
  std::filesystem::remove_all(dir);
}

// Against the shipped fixture: the same metadata, tensor order and types; each MXFP4 block the
// same exponent (or one apart where the f16 block maximum is a power of two), and each code
// the same except where the f16 input lies exactly halfway
// between two codes' values (the f32 weights llama.cpp saw were on either side of it); Q8_0
// blocks within one f16 step of scale and about one quant step of value.
TEST(QuantizeCommand, Mxfp4MoeOfGptOssMatchesFixtureUpToF16InputRounding) {
  const std::string dir = testing::temp_dir();
  const std::string out = dir + "/gpt-oss-mxfp4_moe.gguf";
  const auto r = run_kiln(
      fmt::format("quantize {} {} MXFP4_MOE -t 2", testing::model_path("gpt-oss-f16.gguf"), out),
      dir);
  ASSERT_EQ(r.exit_code, 0) << r.stderr_text;
  const GgufFile ours = open_file(out);
  const GgufFile ref = open_file(testing::model_path("gpt-oss-mxfp4_moe.gguf"));
  const GgufFile src_model = open_file(testing::model_path("gpt-oss-f16.gguf"));
  expect_same_metadata(ours, ref);
  ASSERT_EQ(ours.tensors().size(), ref.tensors().size());
  int64_t n_codes = 0, n_tie_codes = 0, n_mxfp4 = 0, n_exp_blocks = 0;
  for (size_t i = 0; i < ref.tensors().size(); ++i) {
    const TensorInfo& t = ref.tensors()[i];
    const TensorInfo& o = ours.tensors()[i];
    ASSERT_EQ(o.name, t.name);
    ASSERT_EQ(dtype_name(o.dtype), dtype_name(t.dtype)) << t.name;
    const auto a = ours.view(o).bytes, b = ref.view(t).bytes;
    ASSERT_EQ(a.size(), b.size()) << t.name;
    if (t.dtype != DType::MXFP4 && t.dtype != DType::Q8_0) {
      EXPECT_TRUE(std::equal(a.begin(), a.end(), b.begin())) << t.name;  // copied tensors
      continue;
    }
    const TensorInfo* src = src_model.find_tensor(t.name);
    ASSERT_NE(src, nullptr);
    std::vector<float> x(static_cast<size_t>(src->n_elements()));
    dequantize_row(src->dtype, src_model.view(*src).bytes, x);
    const size_t bs = traits(t.dtype).type_size;
    for (size_t blk = 0; blk < a.size() / bs; ++blk) {
      const std::byte* pa = a.data() + blk * bs;
      const std::byte* pb = b.data() + blk * bs;
      const float* xb = x.data() + blk * 32;
      if (t.dtype == DType::MXFP4) {
        ++n_mxfp4;
        if (pa[0] != pb[0]) {
          // The block maximum rounded up to a power of two in f16 (from just below it in
          // f32) moves the exponent by one; any other exponent difference is an error.
          float amax = 0;
          for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
          int e2 = 0;
          const bool pow2 = std::frexp(amax, &e2) == 0.5f;
          ASSERT_TRUE(pow2 && std::abs(int(pa[0]) - int(pb[0])) == 1)
              << t.name << " block " << blk << ": exponents " << int(pa[0]) << " / " << int(pb[0])
              << ", block max " << amax;
          ++n_exp_blocks;
          continue;
        }
        const float d = mxfp4_scale_half(static_cast<uint8_t>(pb[0]));
        for (int j = 0; j < 32; ++j) {
          const int sh = j < 16 ? 0 : 4;
          const int qa = (static_cast<int>(pa[1 + j % 16]) >> sh) & 15;
          const int qb = (static_cast<int>(pb[1 + j % 16]) >> sh) & 15;
          ++n_codes;
          if (qa == qb) continue;
          ++n_tie_codes;
          const double ea = std::fabs(kMxfp4Values[qa] * double(d) - xb[j]);
          const double eb = std::fabs(kMxfp4Values[qb] * double(d) - xb[j]);
          ASSERT_EQ(ea, eb) << t.name << " block " << blk << " element " << j << ": codes " << qa
                            << " / " << qb << " for " << xb[j] << " are not a tie";
        }
      } else {
        f16 da, db;
        std::memcpy(&da, pa, 2);
        std::memcpy(&db, pb, 2);
        ASSERT_LE(std::abs(int(da.bits) - int(db.bits)), 1) << t.name << " block " << blk;
        const float d = f16_to_f32(db);
        for (int j = 0; j < 32; ++j) {
          const float va = f16_to_f32(da) * static_cast<float>(static_cast<int8_t>(pa[2 + j]));
          const float vb = d * static_cast<float>(static_cast<int8_t>(pb[2 + j]));
          // One quant step, plus 127 codes times the scales' one-step difference.
          const float tol = 1.001f * d + 128 * std::fabs(f16_to_f32(da) - d) + 1e-7f;
          ASSERT_LE(std::fabs(va - vb), tol) << t.name << " block " << blk;
        }
      }
    }
  }
  EXPECT_GT(n_mxfp4, 0);
  // Exact ties are a small share of the codes (f16 inputs on the MXFP4 grid's midpoints).
  EXPECT_LT(n_tie_codes * 50, n_codes);
  EXPECT_LT(n_exp_blocks * 50, n_mxfp4);
  std::printf(
      "  MXFP4: %lld blocks, %lld with the exponent one apart (block max a power of two in f16); "
      "%lld codes, %lld differ from the fixture, all at f16 ties\n",
      static_cast<long long>(n_mxfp4), static_cast<long long>(n_exp_blocks),
      static_cast<long long>(n_codes), static_cast<long long>(n_tie_codes));
  std::filesystem::remove_all(dir);
}

TEST(QuantizeCommand, BadInputIsOneLineError) {
  const std::string dir = testing::temp_dir();
  const std::string in = testing::model_path("llama-gqa-f16.gguf");
  struct Case {
    std::string args;
    std::string expect;
  };
  for (const Case& c :
       {Case{fmt::format("quantize {} {}/x.gguf Q9_Z", in, dir), "unknown type 'Q9_Z'"},
        Case{fmt::format("quantize {}/missing.gguf {}/x.gguf Q4_0", dir, dir), "missing.gguf"},
        Case{fmt::format("quantize {} {}/x.gguf Q4_K_M", testing::model_path("llama-gqa-q8_0.gguf"),
                         dir),
             "--allow-requantize"},
        Case{fmt::format("quantize {} {}/no/such/dir/x.gguf Q4_0", in, dir), "x.gguf"}}) {
    const auto r = run_kiln(c.args, dir);
    EXPECT_EQ(r.exit_code, 1) << c.args << ": " << r.stderr_text;
    EXPECT_NE(r.stderr_text.find(c.expect), std::string::npos) << r.stderr_text;
    EXPECT_NE(r.stderr_text.find("kiln quantize: "), std::string::npos) << r.stderr_text;
    EXPECT_FALSE(std::filesystem::exists(dir + "/x.gguf")) << c.args;
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kiln::quant
