// tests/format/gguf_bad_input_test.cpp: malformed GGUF files, each rejected with one line that
// names the problem: no crash, no out-of-bounds read (ASan runs these), no huge allocation.
// Covers the classes behind llama.cpp's GGUF CVEs (offset + size overflow, huge counts and
// string lengths) and Ollama's crafted-GGUF out-of-bounds reads (tensor data past the end).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "common/testdata.h"
#include "format/gguf_craft.h"
#include "format/gguf_writer.h"

namespace kiln {
namespace {

using testing::FailsWith;
using testing::parse_bytes;
using testing::RawGguf;

constexpr uint32_t kF32 = 0, kQ8_0 = 8;

// One valid f32 tensor of `n` elements at offset 0: the base most cases mutate one field of.
std::vector<std::byte> one_tensor_file(std::vector<int64_t> ne, uint32_t type, uint64_t offset,
                                       size_t data_bytes) {
  RawGguf r;
  r.header(1, 0).tensor("w", std::move(ne), type, offset).pad_to(32).zeros(data_bytes);
  return r.bytes();
}

TEST(GgufBadInput, ValidBaseParses) {
  // Guards every case below: each differs from this file in exactly the field it names.
  auto g = parse_bytes(one_tensor_file({4, 2}, kF32, 0, 32));
  ASSERT_TRUE(g) << g.error();
  EXPECT_EQ(g->find_tensor("w")->n_bytes, 32u);
}

TEST(GgufBadInput, TruncatedAtEveryByteOfARealHeader) {
  // Every prefix of a real model that ends before its data does, header bytes included.
  const std::string orig = testing::read_file(testing::model_path("stories260K.gguf"));
  auto full = GgufFile::parse(MappedFile::from_bytes(
      std::vector<std::byte>(reinterpret_cast<const std::byte*>(orig.data()),
                             reinterpret_cast<const std::byte*>(orig.data()) + orig.size())));
  ASSERT_TRUE(full) << full.error();
  const uint64_t header = full->data_offset();
  ASSERT_GT(header, 1000u);
  std::vector<uint64_t> cuts;
  for (uint64_t n = 0; n <= header; ++n) cuts.push_back(n);
  // and a few cuts inside the data section (the last tensor runs past the end)
  for (uint64_t n = header + 1; n < orig.size(); n += (orig.size() - header) / 7) cuts.push_back(n);
  cuts.push_back(orig.size() - 1);
  int failures = 0;
  for (uint64_t n : cuts) {
    std::vector<std::byte> b(reinterpret_cast<const std::byte*>(orig.data()),
                             reinterpret_cast<const std::byte*>(orig.data()) + n);
    auto r = parse_bytes(std::move(b), "cut.gguf");
    if (!FailsWith(r, {"cut.gguf", "invalid GGUF"})) {
      ADD_FAILURE() << "prefix of " << n << " bytes: " << (r ? "parsed" : r.error());
      if (++failures > 5) return;
    }
  }
}

TEST(GgufBadInput, TruncatedWriterFileAtEveryByte) {
  GgufWriter w;
  w.set_str("general.architecture", "llama");
  w.set_str_array("tokenizer.ggml.tokens", {"a", "bc", "def"});
  w.set_f32_array("x.scores", {1, 2, 3});
  w.add_tensor_zeros("t0", DType::F32, {8});
  w.add_tensor_zeros("t1", DType::Q8_0, {32, 2});
  const std::vector<std::byte> full = w.write_to_memory();
  ASSERT_TRUE(parse_bytes(full));
  for (size_t n = 0; n < full.size(); ++n) {
    auto r = parse_bytes(std::vector<std::byte>(full.begin(), full.begin() + n));
    ASSERT_TRUE(FailsWith(r, {"invalid GGUF"})) << "prefix of " << n << " bytes";
  }
}

TEST(GgufBadInput, WrongMagic) {
  auto b = one_tensor_file({8}, kF32, 0, 32);
  b[0] = std::byte{'G'};
  b[1] = std::byte{'G'};
  b[2] = std::byte{'M'};
  b[3] = std::byte{'L'};
  EXPECT_TRUE(FailsWith(parse_bytes(b), {"not a GGUF file", "47 47 4d 4c"}));
  EXPECT_TRUE(FailsWith(parse_bytes({std::byte{'G'}, std::byte{'G'}}), {"too short"}));
}

TEST(GgufBadInput, UnsupportedVersions) {
  for (uint32_t v : {0u, 1u, 4u, 0x03000000u, 0xFFFFFFFFu}) {
    RawGguf r;
    r.header(0, 0, v);
    auto res = parse_bytes(r.bytes());
    EXPECT_TRUE(FailsWith(res, {"version"})) << v;
  }
  RawGguf v2;
  v2.header(0, 0, 2);
  EXPECT_TRUE(parse_bytes(v2.bytes())) << "version 2 must stay readable";
}

TEST(GgufBadInput, CountsLargerThanTheFileCouldHold) {
  for (uint64_t n : {uint64_t{1000}, uint64_t{1} << 40, ~uint64_t{0}}) {
    RawGguf t;
    t.header(n, 0).zeros(200);
    EXPECT_TRUE(FailsWith(parse_bytes(t.bytes()), {"tensor count", "cannot fit"})) << n;
    RawGguf k;
    k.header(0, n).zeros(200);
    EXPECT_TRUE(FailsWith(parse_bytes(k.bytes()), {"metadata count", "cannot fit"})) << n;
  }
}

TEST(GgufBadInput, StringLengthsPastTheEnd) {
  // Key lengths from "a little too long" to values whose pos + len wraps around 2^64.
  for (uint64_t len : {uint64_t{21}, uint64_t{1} << 32, ~uint64_t{0} - 8, ~uint64_t{0}}) {
    RawGguf r;
    r.header(0, 1).u64(len).u32(0x41414141).zeros(16);  // 20 bytes follow the length
    EXPECT_TRUE(FailsWith(parse_bytes(r.bytes()), {"metadata pair 0", "past the end"})) << len;
  }
  // A string value.
  RawGguf v;
  v.header(0, 1).str("k").u32(8).u64(~uint64_t{0} - 3).u32(0);
  EXPECT_TRUE(FailsWith(parse_bytes(v.bytes()), {"metadata 'k'", "string length"}));
  // A tensor name.
  RawGguf t;
  t.header(1, 0).u64(uint64_t{1} << 63).zeros(64);
  EXPECT_TRUE(FailsWith(parse_bytes(t.bytes()), {"tensor 0: name"}));
}

TEST(GgufBadInput, DimensionCounts) {
  for (uint32_t n_dims : {0u, 5u, 0x80000000u}) {
    RawGguf r;
    r.header(1, 0).str("w").u32(n_dims);
    for (int i = 0; i < 5; ++i) r.i64(1);
    r.u32(kF32).u64(0).pad_to(32).zeros(32);
    EXPECT_TRUE(FailsWith(parse_bytes(r.bytes()), {"tensor 'w'", "n_dims is"})) << n_dims;
  }
}

TEST(GgufBadInput, ZeroAndNegativeDimensions) {
  EXPECT_TRUE(FailsWith(parse_bytes(one_tensor_file({4, 0}, kF32, 0, 32)),
                        {"tensor 'w'", "dimension 1 is 0"}));
  EXPECT_TRUE(FailsWith(parse_bytes(one_tensor_file({-4}, kF32, 0, 32)),
                        {"tensor 'w'", "dimension 0 is -4"}));
}

TEST(GgufBadInput, ShapeProductOverflows) {
  const int64_t big = int64_t{1} << 32;
  EXPECT_TRUE(FailsWith(parse_bytes(one_tensor_file({big, big, 2}, kF32, 0, 32)),
                        {"tensor 'w'", "overflows 64 bits"}));
  // Product exactly 2^64 wraps to 0 in unchecked code.
  EXPECT_TRUE(FailsWith(parse_bytes(one_tensor_file({big, big}, kF32, 0, 32)),
                        {"tensor 'w'", "overflows"}));
}

TEST(GgufBadInput, ByteSizeOverflows) {
  // 2^62 f32 elements fit int64, their 2^64 bytes do not.
  EXPECT_TRUE(FailsWith(parse_bytes(one_tensor_file({int64_t{1} << 62}, kF32, 0, 32)),
                        {"tensor 'w'", "byte size overflows"}));
}

TEST(GgufBadInput, RowNotAMultipleOfTheBlock) {
  EXPECT_TRUE(FailsWith(parse_bytes(one_tensor_file({33}, kQ8_0, 0, 64)),
                        {"tensor 'w'", "row length 33", "q8_0"}));
}

TEST(GgufBadInput, DataPastTheEnd) {
  // 8 f32 = 32 bytes, but the data section holds 16.
  EXPECT_TRUE(
      FailsWith(parse_bytes(one_tensor_file({8}, kF32, 0, 16)), {"tensor 'w'", "past the end"}));
  // Offset alone beyond the file.
  EXPECT_TRUE(FailsWith(parse_bytes(one_tensor_file({8}, kF32, 1 << 20, 32)),
                        {"tensor 'w'", "offset 1048576"}));
  // No room for data at all: header ends at the file's end.
  RawGguf r;
  r.header(1, 0).tensor("w", {8}, kF32, 0);
  EXPECT_TRUE(FailsWith(parse_bytes(r.bytes()), {"invalid GGUF"}));
}

TEST(GgufBadInput, OffsetPlusSizeWrapsAround) {
  // The llama.cpp CVE class: offset + n_bytes overflows to a small number that passes a naive
  // "end <= file size" test, and the view then points anywhere.
  const uint64_t off = ~uint64_t{0} - 31;  // aligned to 32
  EXPECT_TRUE(
      FailsWith(parse_bytes(one_tensor_file({16}, kF32, off, 64)), {"tensor 'w'", "past the end"}));
}

TEST(GgufBadInput, MisalignedOffset) {
  RawGguf r;
  r.header(2, 0).tensor("a", {8}, kF32, 0).tensor("b", {8}, kF32, 36).pad_to(32).zeros(128);
  EXPECT_TRUE(FailsWith(parse_bytes(r.bytes()), {"tensor 'b'", "offset 36", "alignment 32"}));
}

TEST(GgufBadInput, OverlappingTensors) {
  RawGguf r;
  r.header(2, 0).tensor("a", {16}, kF32, 0).tensor("b", {8}, kF32, 32).pad_to(32).zeros(128);
  EXPECT_TRUE(FailsWith(parse_bytes(r.bytes()), {"'a'", "'b'", "overlap"}));
  // Listed in reverse offset order: still caught.
  RawGguf s;
  s.header(2, 0).tensor("b", {8}, kF32, 32).tensor("a", {16}, kF32, 0).pad_to(32).zeros(128);
  EXPECT_TRUE(FailsWith(parse_bytes(s.bytes()), {"overlap"}));
  // Identical ranges.
  RawGguf t;
  t.header(2, 0).tensor("a", {8}, kF32, 0).tensor("b", {8}, kF32, 0).pad_to(32).zeros(64);
  EXPECT_TRUE(FailsWith(parse_bytes(t.bytes()), {"overlap"}));
}

TEST(GgufBadInput, DuplicateNames) {
  RawGguf r;
  r.header(2, 0).tensor("a", {8}, kF32, 0).tensor("a", {8}, kF32, 32).pad_to(32).zeros(64);
  EXPECT_TRUE(FailsWith(parse_bytes(r.bytes()), {"duplicate tensor name 'a'"}));
  RawGguf k;
  k.header(0, 2).kv_u32("x", 1).kv_u32("x", 2);
  EXPECT_TRUE(FailsWith(parse_bytes(k.bytes()), {"duplicate metadata key 'x'"}));
}

TEST(GgufBadInput, UnknownDtype) {
  for (uint32_t type : {4u, 5u, 31u, 99u, 0x80000000u}) {
    EXPECT_TRUE(FailsWith(parse_bytes(one_tensor_file({8}, type, 0, 32)),
                          {"tensor 'w'", "unknown tensor type"}))
        << type;
  }
}

TEST(GgufBadInput, UnknownMetadataTypes) {
  RawGguf r;
  r.header(0, 1).str("k").u32(13).u64(0);
  EXPECT_TRUE(FailsWith(parse_bytes(r.bytes()), {"metadata 'k'", "unknown value type 13"}));
  RawGguf a;
  a.header(0, 1).str("k").u32(9).u32(77).u64(1).u64(0);
  EXPECT_TRUE(FailsWith(parse_bytes(a.bytes()), {"metadata 'k'", "unknown element type 77"}));
  RawGguf b;
  b.header(0, 1).str("k").u32(7).u8(2);
  EXPECT_TRUE(FailsWith(parse_bytes(b.bytes()), {"metadata 'k'", "neither 0 nor 1"}));
}

TEST(GgufBadInput, ArraysNestedAThousandDeep) {
  // Unbounded recursion here would overflow the stack; the reader stops at its nesting limit.
  RawGguf r;
  r.header(0, 1).str("deep").u32(9);
  for (int i = 0; i < 1000; ++i) r.u32(9).u64(1);
  r.u32(0).u64(0);
  EXPECT_TRUE(FailsWith(parse_bytes(r.bytes()), {"metadata 'deep'", "nested more than"}));
}

TEST(GgufBadInput, HugeArrayLengths) {
  struct Case {
    uint32_t elem;
    uint64_t n;
  };
  for (Case c : {Case{0, uint64_t{1} << 62}, Case{8, uint64_t{1} << 61}, Case{9, ~uint64_t{0}},
                 Case{12, uint64_t{1} << 61}, Case{4, 1000}}) {
    RawGguf r;
    r.header(0, 1).str("arr").u32(9).u32(c.elem).u64(c.n).zeros(64);
    EXPECT_TRUE(FailsWith(parse_bytes(r.bytes()), {"metadata 'arr'", "cannot fit"}))
        << c.elem << " x " << c.n;
  }
  // An array that does fit the file but would cost ~50x the file in parsed values.
  const uint64_t n = kMaxArrayElements + 1;
  RawGguf big;
  big.header(0, 1).str("arr").u32(9).u32(0).u64(n).zeros(n);
  EXPECT_TRUE(FailsWith(parse_bytes(big.bytes()), {"metadata 'arr'", "exceeds the limit"}));
}

TEST(GgufBadInput, NonUtf8AndEmptyKeys) {
  RawGguf r;
  r.header(0, 1).str("bad\xff\xfekey").u32(4).u32(1);
  EXPECT_TRUE(FailsWith(parse_bytes(r.bytes()), {"metadata pair 0", "not valid UTF-8"}));
  RawGguf o;  // overlong encoding of '/'
  o.header(0, 1).str("a\xc0\xaf").u32(4).u32(1);
  EXPECT_TRUE(FailsWith(parse_bytes(o.bytes()), {"not valid UTF-8"}));
  RawGguf e;
  e.header(0, 1).str("").u32(4).u32(1);
  EXPECT_TRUE(FailsWith(parse_bytes(e.bytes()), {"empty key"}));
}

TEST(GgufBadInput, BadAlignment) {
  for (uint32_t al : {0u, 3u, 48u, 1u << 31}) {
    RawGguf r;
    r.header(0, 1).kv_u32("general.alignment", al);
    EXPECT_TRUE(FailsWith(parse_bytes(r.bytes()), {"general.alignment", "power of two"})) << al;
  }
  RawGguf s;
  s.header(0, 1).str("general.alignment").u32(8).str("32");
  EXPECT_TRUE(FailsWith(parse_bytes(s.bytes()), {"general.alignment has type str"}));
}

TEST(GgufBadInput, LongTensorName) {
  RawGguf r;
  r.header(1, 0).tensor(std::string(64, 'n'), {8}, kF32, 0).pad_to(32).zeros(32);
  EXPECT_TRUE(FailsWith(parse_bytes(r.bytes()), {"tensor 0", "64 bytes long"}));
}

TEST(GgufBadInput, NamesWithControlBytesStayOnOneLine) {
  // Found by fuzz_gguf: a tensor name holding "\r\n" split the error over two lines.
  RawGguf z;
  z.header(1, 0).str(std::string("blk.1\0\r\nx", 9)).u32(0).u32(kF32).u64(0).pad_to(32).zeros(32);
  EXPECT_TRUE(FailsWith(parse_bytes(z.bytes()), {"blk.1\\x00\\x0d\\x0ax", "n_dims is 0"}));
  // A key of 10,000 bytes is cut in the message.
  RawGguf k;
  k.header(0, 1).str(std::string(10000, 'k')).u32(13);
  EXPECT_TRUE(FailsWith(parse_bytes(k.bytes()), {"... (10000 bytes)", "unknown value type 13"}));
}

TEST(GgufBadInput, FilesThatCannotBeMapped) {
  const std::string dir = testing::temp_dir();
  auto missing = GgufFile::open(dir + "/missing.gguf");
  ASSERT_FALSE(missing);
  EXPECT_NE(missing.error().find("missing.gguf"), std::string::npos);
  auto is_dir = GgufFile::open(dir);
  ASSERT_FALSE(is_dir);
  EXPECT_NE(is_dir.error().find("directory"), std::string::npos);
  { std::ofstream(dir + "/empty.gguf"); }
  auto empty = GgufFile::open(dir + "/empty.gguf");
  ASSERT_FALSE(empty);
  EXPECT_NE(empty.error().find("empty"), std::string::npos);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kiln
