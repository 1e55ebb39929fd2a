// tests/format/inspect_cli_test.cpp: `kiln inspect --json` on every shared model and
// vocabulary agrees with GgufFile (counts, names, shapes, offsets, metadata values) and with
// known facts; a bad file exits 1 with one line on stderr.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "common/testdata.h"
#include "format/gguf.h"

namespace kiln {
namespace {

struct RunResult {
  int rc = -1;
  std::string out, err;
};

RunResult run_kiln(const std::string& args) {
  const std::string dir = testing::temp_dir();
  const std::string err_path = dir + "/stderr";
  const std::string cmd = fmt::format("'{}' {} 2>'{}'", testing::kiln_binary(), args, err_path);
  RunResult r;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[65536];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  const int status = ::pclose(p);
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.err = testing::read_file(err_path);
  std::filesystem::remove_all(dir);
  return r;
}

std::vector<std::string> shared_ggufs() {
  std::vector<std::string> out;
  for (const char* dir : {"testdata/models", "testdata/vocab"})
    for (const auto& e : std::filesystem::directory_iterator(testing::shared_path(dir)))
      if (e.path().extension() == ".gguf") out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

// The JSON form of one metadata value equals the parsed value (arrays: the shown prefix).
void expect_value(const nlohmann::json& j, const GgufValue& v, const std::string& key) {
  switch (v.type) {
    case GgufType::STRING:
      EXPECT_EQ(j.get<std::string>(), v.str()) << key;
      break;
    case GgufType::BOOL:
      EXPECT_EQ(j.get<bool>(), std::get<bool>(v.v)) << key;
      break;
    case GgufType::FLOAT32:
    case GgufType::FLOAT64:
      EXPECT_EQ(j.get<double>(), std::get<double>(v.v)) << key;
      break;
    case GgufType::ARRAY: {
      const GgufArray& a = v.arr();
      ASSERT_TRUE(j.is_array()) << key;
      ASSERT_LE(j.size(), a.items.size()) << key;
      for (size_t i = 0; i < j.size(); ++i) expect_value(j[i], a.items[i], key);
      break;
    }
    default:
      if (std::holds_alternative<uint64_t>(v.v))
        EXPECT_EQ(j.get<uint64_t>(), std::get<uint64_t>(v.v)) << key;
      else
        EXPECT_EQ(j.get<int64_t>(), std::get<int64_t>(v.v)) << key;
  }
}

void check_against_file(const nlohmann::json& j, const GgufFile& g, size_t max_items) {
  EXPECT_EQ(j["version"].get<uint32_t>(), g.version());
  EXPECT_EQ(j["alignment"].get<uint64_t>(), g.alignment());
  EXPECT_EQ(j["data_offset"].get<uint64_t>(), g.data_offset());
  EXPECT_EQ(j["file_size"].get<uint64_t>(), g.file_size());
  const auto& md = j["metadata"];
  ASSERT_EQ(md.size(), g.metadata().size());
  for (size_t i = 0; i < md.size(); ++i) {
    const GgufKV& kv = g.metadata()[i];
    EXPECT_EQ(md[i]["key"], kv.key);
    EXPECT_EQ(md[i]["type"], std::string(gguf_type_name(kv.value.type)));
    if (kv.value.is_array()) {
      const size_t len = kv.value.arr().items.size();
      EXPECT_EQ(md[i]["length"].get<size_t>(), len);
      EXPECT_EQ(md[i]["value"].size(), max_items ? std::min(max_items, len) : len);
      EXPECT_EQ(md[i]["truncated"].get<bool>(), max_items != 0 && len > max_items);
    }
    expect_value(md[i]["value"], kv.value, kv.key);
  }
  const auto& ts = j["tensors"];
  ASSERT_EQ(ts.size(), g.tensors().size());
  uint64_t bytes = 0;
  int64_t params = 0;
  for (size_t i = 0; i < ts.size(); ++i) {
    const TensorInfo& t = g.tensors()[i];
    EXPECT_EQ(ts[i]["name"], t.name);
    EXPECT_EQ(ts[i]["dtype"], std::string(dtype_name(t.dtype)));
    EXPECT_EQ(ts[i]["shape"].get<std::vector<int64_t>>(),
              std::vector<int64_t>(t.ne.begin(), t.ne.begin() + t.n_dims));
    EXPECT_EQ(ts[i]["n_bytes"].get<uint64_t>(), t.n_bytes);
    EXPECT_EQ(ts[i]["offset"].get<uint64_t>(), t.offset);
    bytes += t.n_bytes;
    params += t.n_elements();
  }
  EXPECT_EQ(j["totals"]["n_tensors"].get<size_t>(), g.tensors().size());
  EXPECT_EQ(j["totals"]["n_kv"].get<size_t>(), g.metadata().size());
  EXPECT_EQ(j["totals"]["tensor_bytes"].get<uint64_t>(), bytes);
  EXPECT_EQ(j["totals"]["n_params"].get<int64_t>(), params);
}

TEST(InspectCli, JsonAgreesWithTheReaderOnEverySharedFile) {
  const auto files = shared_ggufs();
  ASSERT_GE(files.size(), 30u);
  for (const std::string& path : files) {
    SCOPED_TRACE(path);
    RunResult r = run_kiln(fmt::format("inspect --json '{}'", path));
    ASSERT_EQ(r.rc, 0) << r.err;
    EXPECT_TRUE(r.err.empty()) << r.err;
    auto j = nlohmann::json::parse(r.out, nullptr, /*allow_exceptions=*/false);
    ASSERT_FALSE(j.is_discarded()) << "stdout is not JSON";
    auto g = GgufFile::open(path);
    ASSERT_TRUE(g) << g.error();
    EXPECT_EQ(j["file"], path);
    check_against_file(j, *g, 8);
  }
}

TEST(InspectCli, FullArraysAndKnownFactsOfStories260K) {
  const std::string path = testing::model_path("stories260K.gguf");
  RunResult r = run_kiln(fmt::format("inspect --json --array-items 0 '{}'", path));
  ASSERT_EQ(r.rc, 0) << r.err;
  auto j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded());
  auto g = GgufFile::open(path);
  ASSERT_TRUE(g);
  check_against_file(j, *g, 0);
  // Facts from the model card (llama2.c tinyllamas stories260K), independent of the reader.
  std::map<std::string, nlohmann::json> md;
  for (const auto& e : j["metadata"]) md[e["key"]] = e;
  EXPECT_EQ(md["general.architecture"]["value"], "llama");
  EXPECT_EQ(md["tokenizer.ggml.tokens"]["length"], 512);
  EXPECT_EQ(md["tokenizer.ggml.tokens"]["value"].size(), 512u);
  EXPECT_EQ(md["llama.embedding_length"]["value"], 64);
  EXPECT_EQ(md["llama.block_count"]["value"], 5);
  int attn_q = 0;
  for (const auto& t : j["tensors"])
    if (t["name"].get<std::string>().find("attn_q.weight") != std::string::npos) {
      ++attn_q;
      EXPECT_EQ(t["shape"], nlohmann::json({64, 64}));
    }
  EXPECT_EQ(attn_q, 5);
  // The text form shows the same totals line.
  RunResult text = run_kiln(fmt::format("inspect '{}'", path));
  ASSERT_EQ(text.rc, 0);
  EXPECT_NE(text.out.find(fmt::format("total: {} tensors", g->tensors().size())),
            std::string::npos);
  EXPECT_NE(text.out.find("[512 x str]"), std::string::npos);
}

TEST(InspectCli, BadFileExitsOneWithOneLine) {
  const std::string dir = testing::temp_dir();
  const std::string bad = dir + "/bad.gguf";
  {
    std::ofstream f(bad, std::ios::binary);
    f.write("GGUF\x03\0\0\0", 8);  // truncated right after the version
  }
  for (const std::string& path : {bad, dir + "/missing.gguf", dir}) {
    SCOPED_TRACE(path);
    RunResult r = run_kiln(fmt::format("inspect --json '{}'", path));
    EXPECT_EQ(r.rc, 1);
    EXPECT_TRUE(r.out.empty()) << r.out;
    ASSERT_FALSE(r.err.empty());
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_EQ(r.err.rfind("kiln inspect: ", 0), 0u) << r.err;
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kiln
