// apps/kiln/cmd_chat.cpp: `kiln chat`: an interactive conversation on the model's chat
// template (a plain transcript when the file has none). Each turn re-renders the whole
// conversation and evaluates only what the KV cache does not already hold (the rendered
// history is a prefix of the next turn's), so a long chat costs one prefill, not one per turn.
// Input: a line per message; a line ending in '\' continues on the next; /clear forgets the
// history (the system prompt stays), /exit or end of input leaves.
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "apps/kiln/commands.h"
#include "apps/kiln/config_cli.h"
#include "apps/kiln/gen_common.h"
#include "core/log.h"
#include "engine/chat.h"
#include "sampling/sampler.h"

namespace kiln::app {
namespace {

struct ChatOptions {
  std::string model, system;
  int32_t n_ctx = 0;       // 0: min(training context, 4096)
  int32_t max_reply = -1;  // -1: until the end of generation (or of the context)
  SamplerParams sampling;
  std::shared_ptr<ConfigOverrides> config;
};

// One message from the user: lines until one does not end in '\'. False at end of input.
bool read_message(std::string& out) {
  out.clear();
  std::fputs("> ", stdout);
  std::fflush(stdout);
  for (std::string line; std::getline(std::cin, line);) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (!line.empty() && line.back() == '\\') {
      line.pop_back();
      out += line + "\n";
      continue;
    }
    out += line;
    return true;
  }
  return !out.empty();
}

Status chat(const ChatOptions& o) {
  KILN_ASSIGN_OR_RETURN(Config cfg, load_config(*o.config));
  if (auto lvl = parse_log_level(cfg.log_level)) set_log_level(*lvl);
  if (o.n_ctx < 0) return Status::errorf("-c {} must be >= 0", o.n_ctx);
  if (o.max_reply == 0 || o.max_reply < -1)
    return Status::errorf("-n {} must be > 0, or -1 (until the end)", o.max_reply);
  KILN_ASSIGN_OR_RETURN(std::string path, resolve_model_path(o.model, cfg));
  KILN_ASSIGN_OR_RETURN(const EngineOptions eo, engine_options(cfg));
  KILN_ASSIGN_OR_RETURN(Runtime rt, Runtime::open(path, eo));
  KILN_ASSIGN_OR_RETURN(const ChatTemplate* tmpl, rt.chat_template());
  const Tokenizer& tok = rt.tokenizer();
  const int32_t n_ctx = o.n_ctx > 0 ? o.n_ctx : std::min(rt.model()->n_ctx_train(), 4096);
  KILN_ASSIGN_OR_RETURN(Sampler sampler, Sampler::create(o.sampling, rt.model()->n_vocab()));
  Session session(rt.model(), rt.backend(), n_ctx);
  fmt::print(stderr, "kiln chat: {} ({}, {}), context {}; {}; /clear forgets, /exit leaves\n", path,
             rt.model()->arch_name(), rt.backend().name(), n_ctx,
             tmpl ? "the model's chat template" : "no chat template: a plain transcript");

  std::vector<ChatMessage> messages;
  if (!o.system.empty()) messages.push_back({"system", o.system});
  std::vector<int32_t> held;  // the ids the KV cache holds, in order
  for (std::string text; read_message(text);) {
    if (text == "/exit") break;
    if (text == "/clear") {
      messages.resize(o.system.empty() ? 0 : 1);
      continue;
    }
    if (text.empty()) continue;
    if (size_t bad = invalid_utf8_offset(text); bad != std::string::npos) {
      fmt::print(stderr, "kiln chat: the message is not valid UTF-8 (byte {}); not sent\n", bad);
      continue;
    }
    messages.push_back({"user", text});
    KILN_ASSIGN_OR_RETURN(std::vector<int32_t> ids, chat_prompt(tok, tmpl, messages));
    if (static_cast<int64_t>(ids.size()) >= n_ctx) {
      fmt::print(stderr,
                 "kiln chat: the conversation ({} tokens) fills the context of {}; "
                 "/clear to start over (or -c)\n",
                 ids.size(), n_ctx);
      messages.pop_back();
      continue;
    }
    // Evaluate only what the cache does not hold: the longest common prefix stays.
    size_t keep = 0;
    while (keep < held.size() && keep < ids.size() && held[keep] == ids[keep]) ++keep;
    if (keep == ids.size()) --keep;  // the last prompt token must run to give logits
    KILN_TRY(session.rollback(static_cast<int32_t>(keep)));
    held.assign(ids.begin(), ids.begin() + static_cast<ptrdiff_t>(keep));
    const std::span<const int32_t> rest(ids.data() + keep, ids.size() - keep);
    KILN_ASSIGN_OR_RETURN(std::span<const float> logits, session.eval(rest, false));
    held.insert(held.end(), rest.begin(), rest.end());

    std::string reply;
    Utf8Stream stream;
    const int32_t room = n_ctx - static_cast<int32_t>(held.size());
    const int32_t most = o.max_reply > 0 ? std::min(o.max_reply, room) : room;
    for (int32_t i = 0; i < most; ++i) {
      const int32_t id = sampler.sample(logits);
      sampler.accept(id);
      if (tok.is_eog(id)) break;
      const std::string piece = stream.push(tok.token_to_piece(id, /*special=*/false));
      reply += piece;
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::fflush(stdout);
      if (i + 1 == most) break;
      const int32_t next[1] = {id};
      KILN_ASSIGN_OR_RETURN(logits, session.eval(next, false));
      held.push_back(id);
    }
    const std::string tail = stream.flush();
    reply += tail;
    std::fwrite(tail.data(), 1, tail.size(), stdout);
    std::fputc('\n', stdout);
    messages.push_back({"assistant", reply});
  }
  return Status::ok();
}

}  // namespace

void add_chat_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("chat", "talk with a model on its chat template");
  auto o = std::make_shared<ChatOptions>();
  o->sampling.seed = 42;
  cmd->add_option("-m,--model", o->model, "GGUF model (default: the demo model stories260K)");
  cmd->add_option("-c,--ctx-size", o->n_ctx, "context size (default min(training, 4096))");
  cmd->add_option("--system", o->system, "system prompt");
  cmd->add_option("-n,--n-predict", o->max_reply,
                  "most tokens per reply (default -1: until the end of generation)");
  add_sampling_options(cmd, o->sampling);
  cmd->add_option("-s,--seed", o->sampling.seed, "sampling seed (default 42)");
  o->config = add_config_options(cmd);
  cmd->callback([o, &exit_code] {
    if (Status s = chat(*o); !s) {
      std::fflush(stdout);
      fmt::print(stderr, "kiln chat: {}\n", s.message());
      exit_code = 1;
    }
  });
}

}  // namespace kiln::app
