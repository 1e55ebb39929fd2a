// apps/kiln/main.cpp: the `kiln` command line. Parses, dispatches to a subcommand, and turns
// any error into one line on stderr with a non-zero exit status.
#include <cstdio>
#include <algorithm>
#include <string>
#include <vector>

#include "apps/kiln/commands.h"

int main(int argc, char** argv) {
  CLI::App app{"kiln: run large language models from GGUF files"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "kiln 0.1.0");
  int exit_code = 0;
  kiln::app::add_inspect_command(app, exit_code);
  kiln::app::add_tokenize_command(app, exit_code);
  kiln::app::add_quantize_command(app, exit_code);
  kiln::app::add_template_command(app, exit_code);
  kiln::app::add_mkmodel_command(app, exit_code);
  kiln::app::add_run_command(app, exit_code);
  kiln::app::add_chat_command(app, exit_code);
  kiln::app::add_perplexity_command(app, exit_code);
  kiln::app::add_bench_command(app, exit_code);
  kiln::app::add_logits_command(app, exit_code);
  kiln::app::add_kv_command(app, exit_code);
#ifdef KILN_WITH_SERVER
  kiln::app::add_serve_command(app, exit_code);
#endif
  // llama.cpp's `run -cnv` / `--conversation` is kiln chat (its -p the system prompt).
  std::vector<std::string> args(argv, argv + argc);
  if (args.size() > 1 && args[1] == "run" &&
      std::find_if(args.begin(), args.end(), [](const std::string& a) {
        return a == "-cnv" || a == "--conversation";
      }) != args.end()) {
    std::vector<std::string> chat = {args[0], "chat"};
    for (size_t i = 2; i < args.size(); ++i) {
      if (args[i] == "-cnv" || args[i] == "--conversation") continue;
      chat.push_back(args[i] == "-p" || args[i] == "--prompt" ? "--system" : args[i]);
    }
    args = std::move(chat);
  }
  std::vector<char*> argp;
  for (std::string& a : args) argp.push_back(a.data());
  try {
    app.parse(static_cast<int>(argp.size()), argp.data());
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version, --dev help
    // Every bad command line is one line on stderr and status 1, like every other error.
    std::string msg = e.what();
    for (char& c : msg)
      if (c == '\n') c = ' ';
    std::fprintf(stderr, "kiln: %s (--help lists the options)\n", msg.c_str());
    return 1;
  }
  return exit_code;
}
