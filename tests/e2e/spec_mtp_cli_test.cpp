// tests/e2e/spec_mtp_cli_test.cpp: `kiln run --spec-mtp` end to end: greedy output equals
// plain greedy (same ids hash), acceptance is reported, a model without NextN layers is
// refused with one line, and --spec-mtp with another drafter is refused.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/run_kiln.h"
#include "common/testdata.h"

namespace kiln {
namespace {

using testing::expect_clean_error;
using testing::run_kiln;

std::string ids_line(const std::string& err) {
  const size_t at = err.find("ids xxh64");
  return at == std::string::npos ? std::string() : err.substr(at, err.find('\n', at) - at);
}

TEST(SpecMtpCli, GreedyEqualsPlainAndReportsAcceptance) {
  const std::string model = testing::model_path("glm4moe-f16.gguf");
  const std::vector<std::string> base = {"run", "-m", model,    "-p", "Once upon a time",
                                         "-n",  "20", "--temp", "0"};
  auto plain = run_kiln(base);
  ASSERT_EQ(plain.rc, 0) << plain.err;
  std::vector<std::string> spec = base;
  spec.insert(spec.end(), {"--spec-mtp", "--draft-n", "3"});
  auto mtp = run_kiln(spec);
  ASSERT_EQ(mtp.rc, 0) << mtp.err;
  EXPECT_EQ(mtp.out, plain.out);
  EXPECT_FALSE(ids_line(plain.err).empty()) << plain.err;
  EXPECT_EQ(ids_line(mtp.err), ids_line(plain.err));
  EXPECT_NE(mtp.err.find("speculative (mtp, k=3)"), std::string::npos) << mtp.err;
  EXPECT_NE(mtp.err.find("accepted"), std::string::npos) << mtp.err;
}

TEST(SpecMtpCli, RefusedWithoutNextnLayersAndWithAnotherDrafter) {
  auto p = run_kiln({"run", "-m", testing::model_path("qwen3moe-f16.gguf"), "-p", "Once", "-n", "4",
                     "--spec-mtp"});
  expect_clean_error(p, "NextN");
  auto q = run_kiln({"run", "-m", testing::model_path("glm4moe-f16.gguf"), "-p", "Once", "-n", "4",
                     "--spec-mtp", "--spec-ngram"});
  expect_clean_error(q, "--spec-mtp");
}

}  // namespace
}  // namespace kiln
