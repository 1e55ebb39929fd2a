// apps/kiln/commands.h: one registration function per `kiln` subcommand, each defined in
// its own cmd_*.cpp. main.cpp calls them all; a subcommand's options live with its code.
#pragma once

#include <CLI/CLI.hpp>

namespace kiln::app {

// Each adds its subcommand to `app`; the callback sets `exit_code`.
void add_inspect_command(CLI::App& app, int& exit_code);
void add_tokenize_command(CLI::App& app, int& exit_code);
void add_quantize_command(CLI::App& app, int& exit_code);
void add_template_command(CLI::App& app, int& exit_code);
void add_mkmodel_command(CLI::App& app, int& exit_code);
void add_run_command(CLI::App& app, int& exit_code);
void add_chat_command(CLI::App& app, int& exit_code);
void add_perplexity_command(CLI::App& app, int& exit_code);
void add_bench_command(CLI::App& app, int& exit_code);
void add_logits_command(CLI::App& app, int& exit_code);
void add_serve_command(CLI::App& app, int& exit_code);
void add_kv_command(CLI::App& app, int& exit_code);

}  // namespace kiln::app
