// tests/format/gguf_writer_test.cpp: GgufWriter round trips (write -> GgufFile::open gives the
// same metadata, tensors and bytes), byte-identity with llama.cpp's own files, and the
// writer's refusal of malformed input.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <random>

#include "common/testdata.h"
#include "format/gguf.h"
#include "format/gguf_writer.h"

namespace kiln {
namespace {

bool same_value(const GgufValue& a, const GgufValue& b) {
  if (a.type != b.type || a.v.index() != b.v.index()) return false;
  if (a.is_array()) {
    const GgufArray &x = a.arr(), &y = b.arr();
    if (x.elem_type != y.elem_type || x.items.size() != y.items.size()) return false;
    for (size_t i = 0; i < x.items.size(); ++i)
      if (!same_value(x.items[i], y.items[i])) return false;
    return true;
  }
  switch (a.v.index()) {
    case 0:
      return std::get<0>(a.v) == std::get<0>(b.v);
    case 1:
      return std::get<1>(a.v) == std::get<1>(b.v);
    case 2:
      return std::get<2>(a.v) == std::get<2>(b.v);
    case 3:
      return std::get<3>(a.v) == std::get<3>(b.v);
    case 4:
      return std::get<4>(a.v) == std::get<4>(b.v);
  }
  return false;
}

void expect_same_file(const GgufFile& a, const GgufFile& b) {
  ASSERT_EQ(a.metadata().size(), b.metadata().size());
  for (size_t i = 0; i < a.metadata().size(); ++i) {
    EXPECT_EQ(a.metadata()[i].key, b.metadata()[i].key);
    EXPECT_TRUE(same_value(a.metadata()[i].value, b.metadata()[i].value))
        << "metadata " << a.metadata()[i].key;
  }
  EXPECT_EQ(a.alignment(), b.alignment());
  ASSERT_EQ(a.tensors().size(), b.tensors().size());
  for (size_t i = 0; i < a.tensors().size(); ++i) {
    const TensorInfo &x = a.tensors()[i], &y = b.tensors()[i];
    EXPECT_EQ(x.name, y.name);
    EXPECT_EQ(x.dtype, y.dtype);
    EXPECT_EQ(x.n_dims, y.n_dims);
    EXPECT_EQ(x.ne, y.ne);
    EXPECT_EQ(x.n_bytes, y.n_bytes);
    auto vx = a.view(x).bytes, vy = b.view(y).bytes;
    ASSERT_EQ(vx.size(), vy.size());
    EXPECT_EQ(0, std::memcmp(vx.data(), vy.data(), vx.size())) << "bytes of " << x.name;
  }
}

std::vector<std::byte> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::byte> b(n);
  for (auto& x : b) x = std::byte(rng() & 0xFF);
  return b;
}

GgufValue nested_array() {
  // [[1, 2], [3]] of u16, two levels deep.
  auto u16 = [](uint64_t x) {
    GgufValue v;
    v.type = GgufType::UINT16;
    v.v = x;
    return v;
  };
  GgufArray inner1{GgufType::UINT16, {u16(1), u16(2)}}, inner2{GgufType::UINT16, {u16(3)}};
  GgufValue a1, a2, outer;
  a1.type = a2.type = outer.type = GgufType::ARRAY;
  a1.v = inner1;
  a2.v = inner2;
  outer.v = GgufArray{GgufType::ARRAY, {a1, a2}};
  return outer;
}

TEST(GgufWriter, RoundTripEveryValueTypeAndTensorKind) {
  GgufWriter w(64);
  w.set_str("general.architecture", "llama");
  w.set_u32("llama.block_count", 5);
  w.set_i32("test.neg", -7);
  w.set_u64("test.big", ~0ull);
  w.set_f32("test.eps", 1e-5f);
  w.set_bool("test.flag", true);
  w.set_str("test.unicode", "héllo ✓ \n tab\t");
  w.set_str_array("tokenizer.ggml.tokens", {"<unk>", "a", "", "日本"});
  w.set_f32_array("tokenizer.ggml.scores", {0.f, -1.5f, 3.25f});
  w.set_i32_array("tokenizer.ggml.token_type", {2, 1, 1, 1});
  GgufValue i8;
  i8.type = GgufType::INT8;
  i8.v = int64_t{-128};
  w.set("test.i8", i8);
  GgufValue f64;
  f64.type = GgufType::FLOAT64;
  f64.v = 0.1;
  w.set("test.f64", f64);
  w.set("test.nested", nested_array());
  w.set_u32("llama.block_count", 6);  // replaces in place, keeps position

  const auto f32 = random_bytes(8 * 3 * 4, 1);
  const auto q8 = random_bytes(2 * 34, 2);  // two q8_0 blocks: one row of 64
  const auto q4k = random_bytes(3 * 144, 3);
  w.add_tensor("a.f32", DType::F32, {8, 3}, f32);
  w.add_tensor("b.q8_0", DType::Q8_0, {64}, q8);
  w.add_tensor_zeros("c.zeros", DType::F16, {5, 7, 2});
  w.add_tensor("d.q4_k", DType::Q4_K, {256, 1, 3, 1}, q4k);
  w.add_tensor_produced("e.produced", DType::I32, {10}, [](std::span<std::byte> out) {
    for (size_t i = 0; i < out.size(); ++i) out[i] = std::byte(i * 7);
    return Status::ok();
  });
  ASSERT_TRUE(w.status()) << w.status().message();

  const std::string dir = testing::temp_dir();
  const std::string path = dir + "/rt.gguf";
  ASSERT_TRUE(w.write(path));
  auto g = GgufFile::open(path);
  ASSERT_TRUE(g) << g.error();
  EXPECT_EQ(g->version(), 3u);
  EXPECT_EQ(g->alignment(), 64u);
  EXPECT_EQ(g->file_size(), w.file_size());
  EXPECT_EQ(g->data_offset() % 64, 0u);
  EXPECT_EQ(g->data_offset(), w.header().size());
  EXPECT_EQ(g->metadata()[0].key, "general.alignment");
  EXPECT_EQ(g->metadata()[2].key, "llama.block_count");
  EXPECT_EQ(*g->get<uint32_t>("llama.block_count"), 6u);
  EXPECT_EQ(*g->get<int32_t>("test.neg"), -7);
  EXPECT_EQ(*g->get<uint64_t>("test.big"), ~0ull);
  EXPECT_EQ(*g->get<float>("test.eps"), 1e-5f);
  EXPECT_EQ(*g->get<bool>("test.flag"), true);
  EXPECT_EQ(*g->get<std::string>("test.unicode"), "héllo ✓ \n tab\t");
  EXPECT_EQ(*g->get<int8_t>("test.i8"), -128);
  EXPECT_EQ(*g->get<double>("test.f64"), 0.1);
  EXPECT_EQ(*g->get_array<std::string>("tokenizer.ggml.tokens"),
            (std::vector<std::string>{"<unk>", "a", "", "日本"}));
  EXPECT_EQ(*g->get_array<float>("tokenizer.ggml.scores"), (std::vector<float>{0.f, -1.5f, 3.25f}));
  EXPECT_EQ(*g->get_array<int32_t>("tokenizer.ggml.token_type"),
            (std::vector<int32_t>{2, 1, 1, 1}));
  EXPECT_TRUE(same_value(*g->find("test.nested"), nested_array()));

  ASSERT_EQ(g->tensors().size(), 5u);
  for (const TensorInfo& t : g->tensors()) EXPECT_EQ(t.offset % 64, 0u) << t.name;
  auto bytes_of = [&](const char* n) { return g->tensor(n)->bytes; };
  EXPECT_EQ(0, std::memcmp(bytes_of("a.f32").data(), f32.data(), f32.size()));
  EXPECT_EQ(0, std::memcmp(bytes_of("b.q8_0").data(), q8.data(), q8.size()));
  EXPECT_EQ(0, std::memcmp(bytes_of("d.q4_k").data(), q4k.data(), q4k.size()));
  EXPECT_EQ(g->find_tensor("d.q4_k")->n_dims, 4);
  EXPECT_EQ(g->find_tensor("c.zeros")->n_bytes, 5u * 7 * 2 * 2);
  for (std::byte b : bytes_of("c.zeros")) ASSERT_EQ(b, std::byte{0});
  auto prod = bytes_of("e.produced");
  ASSERT_EQ(prod.size(), 40u);
  for (size_t i = 0; i < prod.size(); ++i) EXPECT_EQ(prod[i], std::byte(i * 7));

  // The in-memory image is the same file.
  auto mem = GgufFile::parse(MappedFile::from_bytes(w.write_to_memory()));
  ASSERT_TRUE(mem) << mem.error();
  expect_same_file(*g, *mem);
  std::filesystem::remove_all(dir);
}

// Re-writing llama.cpp's (gguf-py's) files through GgufWriter gives the same file, byte for
// byte: same field encoding, alignment and tensor layout as the reference writer.
TEST(GgufWriter, RewritesSharedModelsByteForByte) {
  for (const char* name : {"stories260K.gguf", "llama-gqa-q4_k_m.gguf", "qwen3moe-q4_k_m.gguf"}) {
    SCOPED_TRACE(name);
    const std::string path = testing::model_path(name);
    auto src = GgufFile::open(path);
    ASSERT_TRUE(src) << src.error();
    GgufWriter w;
    w.copy_metadata(*src);
    for (const TensorInfo& t : src->tensors())
      w.add_tensor(t.name, t.dtype, std::vector<int64_t>(t.ne.begin(), t.ne.begin() + t.n_dims),
                   src->view(t).bytes);
    auto out = w.to_bytes();
    ASSERT_TRUE(out) << out.error();
    auto again = GgufFile::parse(MappedFile::from_bytes(*out));
    ASSERT_TRUE(again) << again.error();
    expect_same_file(*src, *again);
    const std::string orig = testing::read_file(path);
    ASSERT_EQ(out->size(), orig.size());
    EXPECT_EQ(0, std::memcmp(out->data(), orig.data(), orig.size()));
  }
}

TEST(GgufWriter, SparseZerosTakeNoDisk) {
  const std::string dir = testing::temp_dir();
  GgufWriter w;
  w.add_tensor_zeros("big", DType::F32, {1024, 1024, 16});  // 64 MiB of zeros
  ASSERT_TRUE(w.write(dir + "/sparse.gguf"));
  struct stat st {};
  ASSERT_EQ(0, ::stat((dir + "/sparse.gguf").c_str(), &st));
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), w.file_size());
  EXPECT_LT(static_cast<uint64_t>(st.st_blocks) * 512, 1u << 20) << "holes were not left sparse";
  auto g = GgufFile::open(dir + "/sparse.gguf");
  ASSERT_TRUE(g) << g.error();
  EXPECT_EQ(g->find_tensor("big")->n_bytes, 64u << 20);
  std::filesystem::remove_all(dir);
}

TEST(GgufWriter, RefusesMalformedInputWithOneLine) {
  const std::vector<std::byte> four(4);
  struct Case {
    const char* what;
    std::function<void(GgufWriter&)> add;
  };
  const Case cases[] = {
      {"needs 8 bytes, got 4", [&](GgufWriter& w) { w.add_tensor("t", DType::F32, {2}, four); }},
      {"duplicate tensor 't'",
       [&](GgufWriter& w) {
         w.add_tensor("t", DType::F32, {1}, four);
         w.add_tensor("t", DType::F32, {1}, four);
       }},
      {"has 5 dims",
       [&](GgufWriter& w) {
         w.add_tensor_zeros("t", DType::F32, {1, 1, 1, 1, 1});
       }},
      {"has 0 dims", [&](GgufWriter& w) { w.add_tensor_zeros("t", DType::F32, {}); }},
      {"dimension 1 is 0",
       [&](GgufWriter& w) {
         w.add_tensor_zeros("t", DType::F32, {4, 0});
       }},
      {"not a multiple", [&](GgufWriter& w) { w.add_tensor_zeros("t", DType::Q8_0, {33}); }},
      {"overflows",
       [&](GgufWriter& w) {
         w.add_tensor_zeros("t", DType::F32, {int64_t(1) << 62, 4});
       }},
      {"byte size overflows",
       [&](GgufWriter& w) { w.add_tensor_zeros("t", DType::F64, {int64_t(1) << 62}); }},
      {"must be 1..63 bytes",
       [&](GgufWriter& w) { w.add_tensor_zeros(std::string(64, 'x'), DType::F32, {1}); }},
      {"does not match its type",
       [&](GgufWriter& w) {
         GgufValue v;
         v.type = GgufType::UINT32;
         v.v = std::string("x");
         w.set("k", v);
       }},
      {"does not fit type u8",
       [&](GgufWriter& w) {
         GgufValue v;
         v.type = GgufType::UINT8;
         v.v = uint64_t{256};
         w.set("k", v);
       }},
      {"in an array of",
       [&](GgufWriter& w) {
         GgufValue e;
         e.type = GgufType::INT32;
         e.v = int64_t{1};
         GgufValue v;
         v.type = GgufType::ARRAY;
         v.v = GgufArray{GgufType::FLOAT32, {e}};
         w.set("k", v);
       }},
      {"power of two", [&](GgufWriter& w) { w.set_u32("general.alignment", 48); }},
      {"producing tensor 't': boom",
       [&](GgufWriter& w) {
         w.add_tensor_produced("t", DType::F32, {1},
                               [](std::span<std::byte>) { return Status::error("boom"); });
       }},
  };
  const std::string dir = testing::temp_dir();
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    GgufWriter w;
    c.add(w);
    const std::string path = dir + "/bad.gguf";
    Status s = w.write(path);
    ASSERT_FALSE(s);
    EXPECT_NE(s.message().find(c.what), std::string::npos) << s.message();
    EXPECT_EQ(s.message().find('\n'), std::string::npos);
    EXPECT_FALSE(std::filesystem::exists(path)) << "a failed write left a file behind";
    EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
    EXPECT_FALSE(w.to_bytes());
  }
  std::filesystem::remove_all(dir);
}

TEST(GgufWriter, WriteErrorNamesThePath) {
  GgufWriter w;
  Status s = w.write("/nonexistent-dir-kiln/x.gguf");
  ASSERT_FALSE(s);
  EXPECT_NE(s.message().find("/nonexistent-dir-kiln/x.gguf"), std::string::npos);
}

}  // namespace
}  // namespace kiln
