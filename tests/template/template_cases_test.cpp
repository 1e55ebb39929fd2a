// tests/template/template_cases_test.cpp: every case of the 68 shared chat templates,
// rendered as Jinja2 3.1.6 rendered it (testdata/templates/*.cases.json): outputs must match
// byte for byte and error cases must fail with the template's own message.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "common/testdata.h"
#include "tokenizer/jinja/chat_template.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

struct CaseResult {
  int passed = 0, failed = 0;
};

// Renders one template's cases; records a failure per mismatching case.
CaseResult run_template_cases(const fs::path& cases_path) {
  CaseResult r;
  ojson doc = ojson::parse(testing::read_file(cases_path.string()));
  const fs::path tmpl_path = cases_path.parent_path() / doc["template"].get<std::string>();
  const std::string source = testing::read_file(tmpl_path.string());
  auto tmpl = ChatTemplate::parse(source);
  ChatTemplateOptions opt;
  opt.now = doc["inputs"]["strftime_now_date"].get<std::string>();
  for (const ojson& c : doc["cases"]) {
    const std::string label =
        doc["template"].get<std::string>() + " / " + c["name"].get<std::string>();
    if (!tmpl) {
      ADD_FAILURE() << label << ": parse failed: " << tmpl.error();
      ++r.failed;
      continue;
    }
    ojson ctx = ojson::object();
    for (auto it = doc["inputs"].begin(); it != doc["inputs"].end(); ++it)
      if (it.key() != "strftime_now_date") ctx[it.key()] = it.value();
    ctx["messages"] = c["messages"];
    ctx["add_generation_prompt"] = c["add_generation_prompt"];
    auto out = tmpl->render(ctx, opt);
    if (c.contains("output")) {
      if (!out) {
        ADD_FAILURE() << label << ": render failed: " << out.error();
        ++r.failed;
      } else if (*out != c["output"].get<std::string>()) {
        ADD_FAILURE() << label << ": output differs\n--- expected\n"
                      << c["output"].get<std::string>() << "\n--- got\n"
                      << *out;
        ++r.failed;
      } else {
        ++r.passed;
      }
    } else {
      const std::string want = c["error"].get<std::string>();
      if (out) {
        ADD_FAILURE() << label << ": expected error '" << want << "', rendered:\n" << *out;
        ++r.failed;
      } else if (out.error() != want) {
        ADD_FAILURE() << label << ": error '" << out.error() << "', expected '" << want << "'";
        ++r.failed;
      } else {
        ++r.passed;
      }
    }
  }
  return r;
}

TEST(TemplateCases, AllSharedTemplatesMatchJinja2) {
  const fs::path dir = testing::shared_path("testdata/templates");
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().string().ends_with(".cases.json")) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  ASSERT_EQ(files.size(), 68u) << "expected the 68 shared templates";
  int passed = 0, failed = 0, templates_ok = 0;
  for (const auto& f : files) {
    CaseResult r = run_template_cases(f);
    passed += r.passed;
    failed += r.failed;
    templates_ok += r.failed == 0;
  }
  std::printf("template cases: %d/%d passed, %d/%zu templates fully correct\n", passed,
              passed + failed, templates_ok, files.size());
  EXPECT_EQ(failed, 0);
  EXPECT_EQ(passed, 272);
}

}  // namespace
}  // namespace kiln
