// apps/kiln/main.cpp: the `kiln` command line. Parses, dispatches to a subcommand, and turns
// any error into one line on stderr with a non-zero exit status.
#include <cstdio>
#include <string>

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
  kiln::app::add_perplexity_command(app, exit_code);
  kiln::app::add_bench_command(app, exit_code);
  kiln::app::add_logits_command(app, exit_code);
  kiln::app::add_kv_command(app, exit_code);
#ifdef KILN_WITH_SERVER
  kiln::app::add_serve_command(app, exit_code);
#endif
  try {
    app.parse(argc, argv);
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
