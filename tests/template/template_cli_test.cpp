// tests/template/template_cli_test.cpp: `kiln template` end to end: the binary's stdout must
// be exactly Jinja2's rendering (from a .jinja file and from a GGUF's tokenizer.chat_template
// with bos/eos taken from its vocabulary), and a template error must exit 1 with the message.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/testdata.h"
#include "format/gguf_writer.h"

namespace kiln {
namespace {

using ojson = nlohmann::ordered_json;

struct RunResult {
  int status = -1;
  std::string out, err;
};

RunResult run_kiln(const std::string& args, const std::string& dir) {
  const std::string out_path = dir + "/stdout", err_path = dir + "/stderr";
  std::string cmd =
      "'" + testing::kiln_binary() + "' " + args + " >'" + out_path + "' 2>'" + err_path + "'";
  int rc = std::system(cmd.c_str());
  RunResult r;
  r.status = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  r.out = testing::read_file(out_path);
  r.err = testing::read_file(err_path);
  return r;
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
}

const ojson& find_case(const ojson& doc, const std::string& name) {
  for (const ojson& c : doc["cases"])
    if (c["name"] == name) return c;
  ADD_FAILURE() << "no case " << name;
  static const ojson empty;
  return empty;
}

TEST(TemplateCli, RendersFileExactly) {
  const std::string dir = testing::temp_dir();
  const std::string tdir = testing::shared_path("testdata/templates");
  // A template without strftime_now(), whose output would depend on today's date.
  ojson doc = ojson::parse(testing::read_file(tdir + "/Qwen-Qwen2.5-7B-Instruct.cases.json"));
  for (const char* name :
       {"system-user-assistant-user", "user-assistant-no-prompt", "unicode-multiline"}) {
    const ojson& c = find_case(doc, name);
    write_text(dir + "/messages.json", c["messages"].dump());
    std::string args = "template --template '" + tdir +
                       "/Qwen-Qwen2.5-7B-Instruct.jinja' --messages '" + dir +
                       "/messages.json' --bos-token '<BOS>' --eos-token '<EOS>'";
    if (c["add_generation_prompt"].get<bool>()) args += " --add-generation-prompt";
    RunResult r = run_kiln(args, dir);
    EXPECT_EQ(r.status, 0) << r.err;
    EXPECT_EQ(r.out, c["output"].get<std::string>()) << name;
  }
}

TEST(TemplateCli, RendersGgufTemplateWithVocabularyTokens) {
  const std::string dir = testing::temp_dir();
  const std::string tdir = testing::shared_path("testdata/templates");
  const std::string name = "deepseek-ai-DeepSeek-R1-Distill-Llama-8B";  // prints bos_token
  ojson doc = ojson::parse(testing::read_file(tdir + "/" + name + ".cases.json"));
  GgufWriter w;
  w.set_str("general.architecture", "llama");
  w.set_str("tokenizer.ggml.model", "gpt2");
  w.set_str_array("tokenizer.ggml.tokens", {"a", "<BOS>", "<EOS>", "b"});
  w.set_u32("tokenizer.ggml.bos_token_id", 1);
  w.set_u32("tokenizer.ggml.eos_token_id", 2);
  w.set_str("tokenizer.chat_template", testing::read_file(tdir + "/" + name + ".jinja"));
  ASSERT_TRUE(w.write(dir + "/vocab.gguf").is_ok());
  const ojson& c = find_case(doc, "system-user-assistant-user");
  write_text(dir + "/messages.json", c["messages"].dump());
  RunResult r =
      run_kiln("template -m '" + dir + "/vocab.gguf' --messages '" + dir + "/messages.json'" +
                   (c["add_generation_prompt"].get<bool>() ? " --add-generation-prompt" : ""),
               dir);
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, c["output"].get<std::string>());
  ASSERT_NE(c["output"].get<std::string>().find("<BOS>"), std::string::npos)
      << "case must exercise bos_token";

  // A model without a chat template is a clear error.
  GgufWriter bare;
  bare.set_str("general.architecture", "llama");
  ASSERT_TRUE(bare.write(dir + "/bare.gguf").is_ok());
  r = run_kiln("template -m '" + dir + "/bare.gguf' --messages '" + dir + "/messages.json'", dir);
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("chat_template"), std::string::npos) << r.err;
}

TEST(TemplateCli, TemplateErrorExitsOneWithMessage) {
  const std::string dir = testing::temp_dir();
  const std::string tdir = testing::shared_path("testdata/templates");
  ojson doc = ojson::parse(testing::read_file(tdir + "/google-gemma-2-2b-it.cases.json"));
  const ojson& c = find_case(doc, "system-user-assistant-user");
  ASSERT_TRUE(c.contains("error"));
  write_text(dir + "/messages.json", c["messages"].dump());
  RunResult r = run_kiln("template --template '" + tdir +
                             "/google-gemma-2-2b-it.jinja' --messages '" + dir + "/messages.json'",
                         dir);
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.out, "");
  EXPECT_NE(r.err.find(c["error"].get<std::string>()), std::string::npos) << r.err;

  write_text(dir + "/bad.json", "{\"role\": \"user\"}");
  r = run_kiln("template --template '" + tdir + "/google-gemma-2-2b-it.jinja' --messages '" + dir +
                   "/bad.json'",
               dir);
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("array"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace kiln
