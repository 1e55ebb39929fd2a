// tests/format/gguf_models_test.cpp: every shared model and vocabulary opens, and the index
// agrees with known facts about the files.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include "common/testdata.h"
#include "format/gguf.h"
#include "format/mmap_file.h"
#include "format/page_in.h"

namespace kiln {
namespace {

TEST(GgufModels, EverySharedFileOpens) {
  int n = 0;
  for (const char* dir : {"testdata/models", "testdata/vocab"}) {
    for (const auto& e : std::filesystem::directory_iterator(testing::shared_path(dir))) {
      if (e.path().extension() != ".gguf") continue;
      auto g = GgufFile::open(e.path().string());
      ASSERT_TRUE(g) << g.error();
      EXPECT_GE(g->version(), 2u);
      for (const TensorInfo& t : g->tensors()) {
        TensorView v = g->view(t);
        EXPECT_EQ(v.bytes.size(), t.n_bytes);
        EXPECT_GE(v.bytes.data(), g->mapping()->data());
        EXPECT_LE(v.bytes.data() + v.bytes.size(), g->mapping()->data() + g->file_size());
      }
      ++n;
    }
  }
  EXPECT_GE(n, 30);
}

TEST(GgufModels, Stories260KFacts) {
  auto g = GgufFile::open(testing::model_path("stories260K.gguf"));
  ASSERT_TRUE(g) << g.error();
  EXPECT_EQ(*g->get<std::string>("general.architecture"), "llama");
  EXPECT_EQ(*g->get<uint32_t>("llama.embedding_length"), 64u);
  EXPECT_EQ(*g->get<uint32_t>("llama.block_count"), 5u);
  auto toks = g->get_array<std::string>("tokenizer.ggml.tokens");
  ASSERT_TRUE(toks) << toks.error();
  EXPECT_EQ(toks->size(), 512u);
  auto emb = g->tensor("token_embd.weight");
  ASSERT_TRUE(emb) << emb.error();
  EXPECT_EQ(emb->info->ne[0], 64);
  EXPECT_EQ(emb->info->ne[1], 512);
  // Wrong type and missing key are errors that name the key.
  auto wrong = g->get<std::string>("llama.block_count");
  ASSERT_FALSE(wrong);
  EXPECT_NE(wrong.error().find("llama.block_count"), std::string::npos);
  auto missing = g->get<uint32_t>("llama.no_such_key");
  ASSERT_FALSE(missing);
  EXPECT_NE(missing.error().find("not found"), std::string::npos);
  EXPECT_FALSE(g->tensor("no.such.tensor"));
}

}  // namespace
}  // namespace kiln

namespace kiln {
namespace {

// MappedFile::lock_in_ram (kiln --mlock): the whole mapping locked, or an error saying why.
TEST(MappedFile, LockInRamLocksOrSaysWhy) {
  auto f = MappedFile::open(testing::model_path("stories260K.gguf"));
  ASSERT_TRUE(f) << f.error();
  const Status st = (*f)->lock_in_ram();
  if (!st) {
    EXPECT_NE(st.message().find("mlock"), std::string::npos) << st.message();
  }
  EXPECT_TRUE(MappedFile::from_bytes({})->lock_in_ram()) << "nothing to lock is not an error";
}

// The stepped lock reports its progress: increasing, ending at the file's size.
TEST(MappedFile, LockInRamReportsProgress) {
  // 150 MiB + 1 byte: three 64 MiB steps, the last a partial one.
  const uint64_t size = (uint64_t{150} << 20) + 1;
  auto f = MappedFile::from_bytes(std::vector<std::byte>(size));
  std::vector<uint64_t> seen;
  const Status st = lock_in_ram(*f, [&](uint64_t done, uint64_t total) {
    EXPECT_EQ(total, size);
    seen.push_back(done);
  });
  if (!st) GTEST_SKIP() << st.message();  // a small RLIMIT_MEMLOCK: the refusal is tested above
  EXPECT_EQ(seen, (std::vector<uint64_t>{uint64_t{64} << 20, uint64_t{128} << 20, size}));
}

// page_in (every model a host backend runs without --mlock): the mapping's pages are resident
// afterwards, and the steps report their progress, ending at the file's size. A sparse file
// of 128 MiB + 1 byte: two whole 64 MiB steps and a partial one, none of it cached before.
TEST(MappedFile, PageInMakesTheMappingResident) {
  const std::string path = testing::temp_dir() + "/page_in.bin";
  const uint64_t size = (uint64_t{128} << 20) + 1;
  {
    std::FILE* out = std::fopen(path.c_str(), "wb");
    ASSERT_NE(out, nullptr);
    ASSERT_EQ(::ftruncate(::fileno(out), static_cast<off_t>(size)), 0);
    std::fclose(out);
  }
  auto f = MappedFile::open(path);
  ASSERT_TRUE(f) << f.error();
  const uint64_t page = page_size();
  std::vector<unsigned char> resident((size + page - 1) / page);
  auto n_resident = [&] {
    EXPECT_EQ(::mincore(const_cast<std::byte*>((*f)->data()), size, resident.data()), 0);
    return std::count_if(resident.begin(), resident.end(), [](unsigned char c) { return c & 1; });
  };
  ASSERT_LT(n_resident(), static_cast<ptrdiff_t>(resident.size()));
  std::vector<uint64_t> seen;
  page_in(**f, [&](uint64_t done, uint64_t total) {
    EXPECT_EQ(total, size);
    seen.push_back(done);
  });
  EXPECT_EQ(seen, (std::vector<uint64_t>{uint64_t{64} << 20, uint64_t{128} << 20, size}));
  EXPECT_EQ(n_resident(), static_cast<ptrdiff_t>(resident.size()));
  std::filesystem::remove(path);
  // Bytes already in memory: one report, nothing to read.
  seen.clear();
  page_in(*MappedFile::from_bytes(std::vector<std::byte>(10)),
          [&](uint64_t done, uint64_t) { seen.push_back(done); });
  EXPECT_EQ(seen, std::vector<uint64_t>{10});
}

// move_into_huge_pages (host backends' weights when memory allows): the bytes stay at their
// addresses with their values, read-only, and the range is anonymous memory afterwards (no
// longer the file's mapping); steps of 64 MiB report progress. Where the kernel has huge pages
// off the call refuses and the mapping is as it was. A file below one huge page, or bytes that
// are not a file mapping, are refused.
TEST(MappedFile, MoveIntoHugePagesKeepsAddressesAndBytes) {
  const std::string path = testing::temp_dir() + "/huge_pages.bin";
  const uint64_t size = (uint64_t{64} << 20) + (uint64_t{3} << 20) + 123;
  std::vector<std::byte> want(size);
  std::mt19937_64 rng(3);
  for (std::byte& b : want) b = static_cast<std::byte>(rng());
  {
    std::FILE* out = std::fopen(path.c_str(), "wb");
    ASSERT_NE(out, nullptr);
    ASSERT_EQ(std::fwrite(want.data(), 1, size, out), size);
    std::fclose(out);
  }
  auto f = MappedFile::open(path);
  ASSERT_TRUE(f) << f.error();
  const std::byte* at = (*f)->data();
  std::ifstream thp("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string mode;
  std::getline(thp, mode);
  const bool thp_on = mode.find("[never]") == std::string::npos && !mode.empty();
  std::vector<uint64_t> seen;
  const bool moved = move_into_huge_pages(**f, [&](uint64_t done, uint64_t total) {
    EXPECT_EQ(total, size);
    seen.push_back(done);
  });
  EXPECT_EQ(moved, thp_on) << "THP: " << mode;
  EXPECT_EQ((*f)->data(), at);
  EXPECT_EQ(std::memcmp(at, want.data(), size), 0);
  // The /proc/self/maps line of the range: anonymous and read-only once moved, else the file.
  std::ifstream maps("/proc/self/maps");
  std::string line, ours;
  const std::string start = fmt::format("{:x}-", reinterpret_cast<uintptr_t>(at));
  while (std::getline(maps, line))
    if (line.starts_with(start)) ours = line;
  ASSERT_FALSE(ours.empty());
  if (moved) {
    EXPECT_EQ(seen, (std::vector<uint64_t>{uint64_t{64} << 20, size}));
    EXPECT_EQ(ours.find("huge_pages.bin"), std::string::npos) << ours;
    EXPECT_NE(ours.find(" r--p "), std::string::npos) << ours;
  } else {
    EXPECT_NE(ours.find("huge_pages.bin"), std::string::npos) << ours;
  }
  f->reset();  // unmaps the moved bytes as it would the file's
  std::filesystem::remove(path);

  const std::string small = testing::temp_dir() + "/huge_pages_small.bin";
  {
    std::FILE* out = std::fopen(small.c_str(), "wb");
    ASSERT_NE(out, nullptr);
    ASSERT_EQ(::ftruncate(::fileno(out), off_t{1} << 20), 0);
    std::fclose(out);
  }
  auto g = MappedFile::open(small);
  ASSERT_TRUE(g) << g.error();
  EXPECT_FALSE(move_into_huge_pages(**g));
  std::filesystem::remove(small);
  EXPECT_FALSE(move_into_huge_pages(*MappedFile::from_bytes(std::vector<std::byte>(4 << 20))));
}

}  // namespace
}  // namespace kiln
