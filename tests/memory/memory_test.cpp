// tests/memory/memory_test.cpp: owners vs views (Bytes keeps the mapping alive; views are
// checked when made), buffer alignment and zero-fill, poison detection of premature KV reads,
// and page rounding.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "common/testdata.h"
#include "format/gguf.h"
#include "format/gguf_writer.h"
#include "memory/buffers.h"
#include "memory/bytes.h"

namespace kiln {
namespace {

std::vector<std::byte> iota_bytes(size_t n) {
  std::vector<std::byte> b(n);
  for (size_t i = 0; i < n; ++i) b[i] = std::byte(i & 0xFF);
  return b;
}

TEST(ByteView, SlicesAreCheckedWhenMade) {
  const auto data = iota_bytes(100);
  ByteView v(data);
  auto ok = v.slice(10, 90);
  ASSERT_TRUE(ok) << ok.error();
  EXPECT_EQ(ok->size(), 90u);
  EXPECT_EQ(ok->data()[0], std::byte{10});
  EXPECT_TRUE(v.slice(100, 0));  // empty at the end is fine
  EXPECT_FALSE(v.slice(101, 0));
  EXPECT_FALSE(v.slice(50, 51));
  // offset + length wraps around 2^64: must not pass as "small".
  auto wrap = v.slice(10, ~uint64_t{0} - 5);
  ASSERT_FALSE(wrap);
  EXPECT_NE(wrap.error().find("outside a view of 100 bytes"), std::string::npos);
  EXPECT_FALSE(ok->slice(0, 91));  // relative to the sub-view, not the parent
  EXPECT_EQ(v.subview(1, 2).data()[1], std::byte{2});
}

TEST(ByteViewDeathTest, SubviewPastTheEndAborts) {
  const auto data = iota_bytes(16);
  ByteView v(data);
  EXPECT_DEATH(v.subview(8, 9), "subview");
}

TEST(Bytes, MappingLivesAsLongAsAnyOwner) {
  const std::string dir = testing::temp_dir();
  const std::string path = dir + "/m.gguf";
  const auto payload = iota_bytes(256);
  GgufWriter w;
  w.add_tensor("t", DType::I8, {256}, payload);
  ASSERT_TRUE(w.write(path));

  Bytes tensor;
  std::weak_ptr<const MappedFile> watch;
  {
    auto g = GgufFile::open(path);
    ASSERT_TRUE(g) << g.error();
    watch = g->mapping();
    auto t = Bytes::of_tensor(*g, "t");
    ASSERT_TRUE(t) << t.error();
    tensor = std::move(*t);
    EXPECT_EQ(tensor.owners(), 2);  // the GgufFile and the Bytes
    EXPECT_FALSE(Bytes::of_tensor(*g, "nope"));
  }
  // The GgufFile is gone, the mapping is not: the Bytes still reads the file's bytes.
  EXPECT_FALSE(watch.expired());
  EXPECT_EQ(tensor.owners(), 1);
  ASSERT_EQ(tensor.size(), 256u);
  EXPECT_EQ(0, std::memcmp(tensor.data(), payload.data(), 256));
  auto part = tensor.slice(16, 32);
  ASSERT_TRUE(part);
  EXPECT_EQ(part->owners(), 2);
  EXPECT_EQ(part->data()[0], std::byte{16});
  EXPECT_FALSE(tensor.slice(250, 7));
  tensor = Bytes();
  EXPECT_FALSE(watch.expired());  // `part` still owns it
  part = Bytes();
  EXPECT_TRUE(watch.expired()) << "last owner gone, mapping must be released";
  std::filesystem::remove_all(dir);
}

TEST(Bytes, CopyOfIsIndependent) {
  auto src = iota_bytes(10);
  Bytes b = Bytes::copy_of(src);
  src[0] = std::byte{99};
  EXPECT_EQ(b.data()[0], std::byte{0});
  EXPECT_EQ(b.view().size(), 10u);
}

TEST(Buffers, ZerosAreZeroAndAligned) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{15}, size_t{16}, size_t{1000}, size_t{1} << 20}) {
    F32Buffer f = F32Buffer::zeros(n);
    F16Buffer h = F16Buffer::zeros(n);
    ASSERT_EQ(f.size(), n);
    ASSERT_EQ(h.size(), n);
    if (n == 0) continue;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(f.data()) % kBufferAlignment, 0u);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(h.data()) % kBufferAlignment, 0u);
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(f[i], 0.0f);
      ASSERT_EQ(h.data()[i].bits, 0);
    }
  }
}

TEST(Buffers, OwnersHaveTheirOwnIdentity) {
  F32Buffer a = F32Buffer::zeros(8);
  a[3] = 2.5f;
  F32Buffer b = a.clone();
  b[3] = 7;
  EXPECT_EQ(a[3], 2.5f);
  EXPECT_NE(a.data(), b.data());
  F32Buffer c = std::move(a);
  EXPECT_EQ(c[3], 2.5f);
  EXPECT_EQ(a.size(), 0u);  // NOLINT: moved-from is empty by contract
  static_assert(!std::is_copy_constructible_v<F32Buffer>);
  static_assert(!std::is_copy_constructible_v<F16Buffer>);
}

TEST(Buffers, F16RowsAreRangeChecked) {
  F16Buffer h = F16Buffer::zeros(12);
  EXPECT_EQ(h.row(2, 4).data(), h.data() + 8);
  EXPECT_DEATH(h.row(3, 4), "row 3 of width 4");
}

TEST(Poison, PrematureReadOfKvRowsIsDetected) {
  if (!kPoisonEnabled) GTEST_SKIP() << "KILN_POISON is off in this build (debug/asan presets)";
  const size_t width = 8, rows = 6;
  F16Buffer plane = F16Buffer::uninitialized(width * rows);
  for (size_t i = 0; i < plane.size(); ++i) ASSERT_EQ(plane.data()[i].bits, kPoisonF16);
  // Write rows 0..3 the way a KV append does; rows 4 and 5 stay unwritten.
  for (size_t r = 0; r < 4; ++r)
    for (f16& x : plane.row(r, width)) x = f32_to_f16(float(r));
  EXPECT_TRUE(poisoned_rows(plane.span(), width, 0, 4).empty());
  EXPECT_EQ(poisoned_rows(plane.span(), width, 0, rows), (std::vector<size_t>{4, 5}));
  EXPECT_TRUE(check_not_poisoned(plane.row(3, width), "layer 0 K row 3"));
  // An attention read that wrongly includes row 4 (say, an off-by-one in the ring length).
  Status s = check_not_poisoned(plane.row(4, width), "layer 0 K row 4");
  ASSERT_FALSE(s);
  EXPECT_NE(s.message().find("layer 0 K row 4"), std::string::npos);
  EXPECT_NE(s.message().find("0x7e11"), std::string::npos);
  // The poison pattern survives being read as a float: a NaN that propagates loudly.
  EXPECT_TRUE(std::isnan(f16_to_f32(plane.row(5, width)[0])));
}

TEST(Poison, ComputedNansAreNotPoison) {
  // Arithmetic NaNs converted to f16 never equal the pattern, so no false alarms.
  const f16 nan = f32_to_f16(std::numeric_limits<float>::quiet_NaN());
  const f16 neg = f32_to_f16(-std::numeric_limits<float>::quiet_NaN());
  EXPECT_NE(nan.bits, kPoisonF16);
  EXPECT_NE(neg.bits, kPoisonF16);
  F16Buffer z = F16Buffer::zeros(4);
  z.data()[1] = nan;
  EXPECT_TRUE(check_not_poisoned(z.span(), "zeros"));
}

TEST(PageRegion, TenByteFile) {
  const std::string dir = testing::temp_dir();
  const std::string path = dir + "/ten.bin";
  { std::ofstream(path, std::ios::binary) << "0123456789"; }
  auto f = MappedFile::open(path);
  ASSERT_TRUE(f) << f.error();
  ASSERT_EQ((*f)->size(), 10u);
  PageRegion r = page_region((*f)->bytes());
  EXPECT_EQ(r.base, (*f)->data());  // a mapping starts on a page
  EXPECT_EQ(r.offset, 0u);
  EXPECT_EQ(r.logical_bytes, 10u);         // consumers see exactly the file
  EXPECT_EQ(r.device_bytes, page_size());  // the device sees one whole page
  EXPECT_EQ(reinterpret_cast<uintptr_t>(r.base) % page_size(), 0u);
  // A slice in the middle of a page rounds its base down and its length up.
  Bytes all = Bytes::of(*f);
  auto mid = all.slice(3, 5);
  ASSERT_TRUE(mid);
  PageRegion m = page_region(mid->span(), 16);
  EXPECT_EQ(m.base, (*f)->data());
  EXPECT_EQ(m.offset, 3u);
  EXPECT_EQ(m.logical_bytes, 5u);
  EXPECT_EQ(m.device_bytes, 16u);
  // 16 KiB pages (Apple Silicon's) over a range that crosses a page boundary.
  static const std::vector<std::byte> buf(3 * 16384);
  const std::byte* aligned =
      reinterpret_cast<const std::byte*>(round_up(reinterpret_cast<uintptr_t>(buf.data()), 16384));
  PageRegion c = page_region(std::span(aligned + 16000, 1000), 16384);
  EXPECT_EQ(c.base, aligned);
  EXPECT_EQ(c.offset, 16000u);
  EXPECT_EQ(c.device_bytes, 32768u);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kiln
