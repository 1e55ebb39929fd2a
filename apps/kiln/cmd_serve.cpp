// apps/kiln/cmd_serve.cpp: `kiln serve`: the OpenAI-compatible HTTP server. Listens first
// (so /health answers 503 while the model loads), then loads, then serves until SIGTERM or
// SIGINT, when in-flight requests are cancelled and the process exits cleanly.
#include <fmt/format.h>
#include <signal.h>

#include <cstdio>
#include <memory>
#include <string>

#include "apps/kiln/commands.h"
#include "apps/kiln/config_cli.h"
#include "apps/kiln/gen_common.h"
#include "core/log.h"
#include "server/server.h"

namespace kiln::app {
namespace {

struct ServeOptions {
  std::string model;
  server::ServerOptions server;
  size_t max_body_kib = 1024;
  std::shared_ptr<ConfigOverrides> config;
};

Status serve(ServeOptions o) {
  KILN_ASSIGN_OR_RETURN(Config cfg, load_config(*o.config));
  if (auto lvl = parse_log_level(cfg.log_level)) set_log_level(*lvl);
  KILN_ASSIGN_OR_RETURN(o.server.model_path, resolve_model_path(o.model, cfg));
  if (o.server.port < 0 || o.server.port > 65535)
    return Status::errorf("--port {} must be in [0, 65535]", o.server.port);
  if (o.server.n_parallel < 1) return Status::errorf("--parallel {} must be >= 1", o.server.n_parallel);
  if (o.server.n_ctx < 0) return Status::errorf("--ctx-size {} must be >= 0", o.server.n_ctx);
  if (o.server.prefill_chunk < 1)
    return Status::errorf("--prefill-chunk {} must be >= 1", o.server.prefill_chunk);
  if (o.server.max_queue < 0) return Status::errorf("--max-queue {} must be >= 0", o.server.max_queue);
  if (o.max_body_kib < 1) return Status::error("--max-body-kib must be >= 1");
  o.server.max_body_bytes = o.max_body_kib * 1024;
  o.server.cpu_threads = static_cast<int>(cfg.threads);

  // Signals go to sigwait below, not to whichever server thread happens to run.
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGTERM);
  sigaddset(&sigs, SIGINT);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);

  server::HttpServer srv(o.server);
  KILN_TRY(srv.start());
  fmt::print(stderr, "kiln serve: listening on http://{}:{}\n", o.server.host, srv.port());
  std::fflush(stderr);
  KILN_TRY(srv.load());
  fmt::print(stderr, "kiln serve: model {} ready ({} slots)\n", srv.model_name(), o.server.n_parallel);
  std::fflush(stderr);
  int sig = 0;
  sigwait(&sigs, &sig);
  fmt::print(stderr, "kiln serve: {} received, shutting down\n", sig == SIGTERM ? "SIGTERM" : "SIGINT");
  srv.stop();
  fmt::print(stderr, "kiln serve: stopped\n");
  return Status::ok();
}

}  // namespace

void add_serve_command(CLI::App& app, int& exit_code) {
  auto* cmd = app.add_subcommand("serve", "OpenAI-compatible HTTP server");
  auto o = std::make_shared<ServeOptions>();
  cmd->add_option("-m,--model", o->model, "GGUF model (default: the demo model stories260K)");
  cmd->add_option("--host", o->server.host, "address to listen on (default 127.0.0.1)");
  cmd->add_option("--port", o->server.port, "port (default 8080; 0: any free port)");
  cmd->add_option("--parallel", o->server.n_parallel, "concurrent slots (default 4)");
  cmd->add_option("-c,--ctx-size", o->server.n_ctx, "context per slot (default min(training, 4096))");
  cmd->add_option("--prefill-chunk", o->server.prefill_chunk, "prompt tokens per slot step (default 256)");
  cmd->add_option("--max-queue", o->server.max_queue, "waiting requests before 503 (default 64)");
  cmd->add_option("--api-key", o->server.api_key, "require 'Authorization: Bearer KEY'");
  cmd->add_option("--max-body-kib", o->max_body_kib, "request body limit in KiB (default 1024)");
  o->config = add_config_options(cmd);
  cmd->callback([o, &exit_code] {
    if (Status s = serve(*o); !s) {
      fmt::print(stderr, "kiln serve: {}\n", s.message());
      exit_code = 1;
    }
  });
}

}  // namespace kiln::app
