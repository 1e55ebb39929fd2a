// apps/kiln/cmd_template.cpp: `kiln template`: render a chat template (from a GGUF's
// tokenizer.chat_template or a .jinja file) over a JSON conversation, exactly, to stdout.
#include <fmt/format.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>

#include "apps/kiln/commands.h"
#include "core/json_depth.h"
#include "format/gguf.h"
#include "tokenizer/jinja/chat_template.h"

namespace kiln::app {
namespace {

struct TemplateArgs {
  std::string model;
  std::string template_file;
  std::string messages_file;
  bool add_generation_prompt = false;
  std::optional<std::string> bos_token, eos_token;
};

Expected<std::string> read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return Status::errorf("cannot read '{}'", path);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// The vocabulary's string for a special token id key ("tokenizer.ggml.bos_token_id").
Expected<std::string> special_token(const GgufFile& g, std::string_view id_key) {
  if (!g.has(id_key)) return std::string();
  KILN_ASSIGN_OR_RETURN(uint32_t id, g.get<uint32_t>(id_key));
  const GgufValue* toks = g.find("tokenizer.ggml.tokens");
  if (!toks || !toks->is_array())
    return Status::errorf("{} is set but tokenizer.ggml.tokens is missing", id_key);
  const GgufArray& arr = toks->arr();
  if (id >= arr.items.size() || !arr.items[id].is_string())
    return Status::errorf("{} = {} is outside the vocabulary ({} tokens)", id_key, id,
                          arr.items.size());
  return arr.items[id].str();
}

Expected<std::string> render(const TemplateArgs& a) {
  std::string source;
  std::string bos, eos;
  if (!a.model.empty()) {
    KILN_ASSIGN_OR_RETURN(GgufFile g, GgufFile::open(a.model));
    if (!g.has("tokenizer.chat_template"))
      return Status::errorf("'{}' has no tokenizer.chat_template (use --template FILE.jinja)",
                            a.model);
    KILN_ASSIGN_OR_RETURN(source, g.get<std::string>("tokenizer.chat_template"));
    KILN_ASSIGN_OR_RETURN(bos, special_token(g, "tokenizer.ggml.bos_token_id"));
    KILN_ASSIGN_OR_RETURN(eos, special_token(g, "tokenizer.ggml.eos_token_id"));
  } else {
    KILN_ASSIGN_OR_RETURN(source, read_text(a.template_file));
  }
  if (a.bos_token) bos = *a.bos_token;
  if (a.eos_token) eos = *a.eos_token;

  // The array itself ('[' first) or a file holding it.
  const size_t first = a.messages_file.find_first_not_of(" \t\r\n");
  const bool inline_json = first != std::string::npos && a.messages_file[first] == '[';
  const std::string where = inline_json ? std::string("--messages") : "'" + a.messages_file + "'";
  std::string messages_text = a.messages_file;
  if (!inline_json) {
    KILN_ASSIGN_OR_RETURN(messages_text, read_text(a.messages_file));
  }
  if (json_nesting_depth(messages_text) > kMaxJsonDepth)
    return Status::errorf("{} is {}", where, kJsonTooDeep);
  nlohmann::ordered_json messages = nlohmann::ordered_json::parse(messages_text, nullptr, false);
  if (messages.is_discarded()) return Status::errorf("{} is not valid JSON", where);
  if (!messages.is_array()) return Status::errorf("{} must hold a JSON array of messages", where);
  for (size_t k = 0; k < messages.size(); ++k)
    if (!messages[k].is_object() || !messages[k].contains("role"))
      return Status::errorf("{}: message {} is not an object with a \"role\"", where, k);

  nlohmann::ordered_json ctx = nlohmann::ordered_json::object();
  ctx["messages"] = std::move(messages);
  ctx["add_generation_prompt"] = a.add_generation_prompt;
  ctx["bos_token"] = bos;
  ctx["eos_token"] = eos;
  return render_chat_template(source, ctx);
}

}  // namespace

void add_template_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("template", "render a chat template over a JSON conversation");
  auto a = std::make_shared<TemplateArgs>();
  auto* m =
      cmd->add_option("-m,--model", a->model, "GGUF file whose tokenizer.chat_template is used");
  auto* t = cmd->add_option("--template", a->template_file, "Jinja template file");
  m->excludes(t);
  cmd->add_option("--messages", a->messages_file,
                  "a JSON array of {\"role\", \"content\"} messages, or a file holding one")
      ->required();
  cmd->add_flag("--add-generation-prompt", a->add_generation_prompt,
                "end with the assistant prompt");
  cmd->add_option_function<std::string>(
      "--bos-token", [a](const std::string& s) { a->bos_token = s; }, "bos_token value");
  cmd->add_option_function<std::string>(
      "--eos-token", [a](const std::string& s) { a->eos_token = s; }, "eos_token value");
  cmd->callback([a, &exit_code] {
    if (a->model.empty() && a->template_file.empty()) {
      fmt::print(stderr, "kiln template: one of -m MODEL or --template FILE is required\n");
      exit_code = 1;
      return;
    }
    auto out = render(*a);
    if (!out) {
      fmt::print(stderr, "kiln template: {}\n", out.error());
      exit_code = 1;
      return;
    }
    std::fwrite(out->data(), 1, out->size(), stdout);
    std::fflush(stdout);
    exit_code = 0;
  });
}

}  // namespace kiln::app
