// apps/kiln/cmd_serve.cpp: `kiln serve`: the OpenAI-compatible HTTP server. Listens first
// (so /health answers 503 while the model loads), then loads, then serves until SIGTERM or
// SIGINT, when in-flight requests are cancelled and the process exits cleanly.
#include <fmt/format.h>
#include <signal.h>
#include <sys/resource.h>

#include <cstdio>
#include <memory>
#include <string>

#include "apps/kiln/commands.h"
#include "apps/kiln/config_cli.h"
#include "apps/kiln/gen_common.h"
#include "apps/kiln/prefill_node.h"
#include "core/log.h"
#include "format/gguf.h"
#include "engine/scheduler.h"
#include "server/api.h"
#include "server/server.h"
#include "transfer/remote_prefill.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <type_traits>
#include <atomic>
#include <nlohmann/json.hpp>
#include <cstdlib>
#include <thread>
#include <variant>

namespace kiln::app {
namespace {

struct ServeOptions {
  std::string model;
  server::ServerOptions server;
  // The connection and size limits (server/limits.h) in the units the options take.
  size_t max_body_kib = 1024, max_header_kib = 64, max_response_kib = 64 << 10;
  double header_timeout_s = 10, body_timeout_s = 60, idle_timeout_s = 5, write_timeout_s = 30;
  std::string limits;        // --limits KEY=VALUE,...
  float temperature = 1.0f;  // --temp
  std::string sampling;      // --sampling KEY=VALUE,...
  std::shared_ptr<ConfigOverrides> config;
  // Disaggregated prefill (docs/kvpack.md): "standalone", "prefill" (serve KV to decode nodes
  // on --kv-port, no HTTP) or "decode" (HTTP; prompts prefilled by --prefill-peer).
  std::string role = "standalone";
  std::string prefill_peer, kv_transport = "tcp";
  int kv_port = 7070;
  int64_t prefill_timeout_ms = 30000;
  std::string cors;  // --cors ORIGIN[,ORIGIN...] or *
};

// --cors "https://a.example,http://localhost:3000" or "*": the origins, each a scheme and a
// host (a trailing slash or a path is a mistake a browser would never match: refused).
Expected<std::vector<std::string>> cors_origins(const std::string& spec) {
  std::vector<std::string> out;
  for (size_t at = 0; at < spec.size();) {
    size_t end = spec.find(',', at);
    if (end == std::string::npos) end = spec.size();
    const std::string o = spec.substr(at, end - at);
    at = end + 1;
    const size_t scheme = o.find("://");
    const bool ok =
        o == "*" || (scheme != std::string::npos && scheme > 0 && o.size() > scheme + 3 &&
                     o.find('/', scheme + 3) == std::string::npos);
    if (!ok)
      return Status::errorf("--cors '{}': each origin must be scheme://host[:port] (no path), or *",
                            o);
    out.push_back(o);
  }
  return out;
}

// --temp and --sampling "top_k=40,min_p=0.05,...": the defaults of requests that leave a
// sampling field out, named as the request fields are and checked by the request parser
// itself, on a request that sets them all (one option for the rest keeps --help a screen).
Status sampling_defaults(float temperature, const std::string& spec,
                         server::SamplingDefaults& out) {
  static constexpr std::string_view kFields[] = {
      "top_k", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty"};
  nlohmann::json body = {{"prompt", "x"}, {"temperature", temperature}};
  for (size_t at = 0; at < spec.size();) {
    size_t end = spec.find(',', at);
    if (end == std::string::npos) end = spec.size();
    const std::string item = spec.substr(at, end - at);
    at = end + 1;
    const size_t eq = item.find('=');
    const std::string key = item.substr(0, eq);
    if (eq == std::string::npos ||
        std::find(std::begin(kFields), std::end(kFields), key) == std::end(kFields))
      return Status::errorf(
          "--sampling '{}': expected KEY=VALUE with KEY one of top_k, top_p, "
          "min_p, repeat_penalty, presence_penalty, frequency_penalty",
          item);
    const auto value = nlohmann::json::parse(item.substr(eq + 1), nullptr, false);
    if (!value.is_number())
      return Status::errorf("--sampling '{}': the value must be a number", item);
    body[key] = value;
  }
  auto r = server::parse_completion_request(body.dump(), /*chat=*/false);
  if (const auto* e = std::get_if<server::ApiError>(&r))
    return Status::errorf("{}: {}", e->param == "temperature" ? "--temp" : "--sampling",
                          e->message);
  const server::CompletionRequest& c = std::get<server::CompletionRequest>(r);
  out.temperature = c.temperature;
  out.top_k = c.top_k;
  out.top_p = c.top_p;
  out.min_p = c.min_p;
  out.repeat_penalty = c.repeat_penalty;
  out.presence_penalty = c.presence_penalty;
  out.frequency_penalty = c.frequency_penalty;
  return Status::ok();
}

// The limits options onto ServerLimits; each must be positive (no limit means no option).
Status server_limits(const ServeOptions& o, server::ServerLimits& l) {
  auto kib = [](const char* name, size_t v, size_t& out) -> Status {
    if (v < 1 || v > (size_t(1) << 30))
      return Status::errorf("--limits {}={} must be in [1, 2^30]", name, v);
    out = v << 10;
    return Status::ok();
  };
  auto ms = [](const char* name, double s, int32_t& out) -> Status {
    if (!(s > 0) || s > 86400)
      return Status::errorf("--limits {}={} must be in (0, 86400] seconds", name, s);
    out = std::max<int32_t>(1, int32_t(s * 1000));
    return Status::ok();
  };
  // --limits KEY=VALUE,...: each key names a field below (sizes in KiB, times in seconds).
  ServeOptions v = o;
  for (size_t at = 0; at < o.limits.size();) {
    size_t end = o.limits.find(',', at);
    if (end == std::string::npos) end = o.limits.size();
    const std::string item = o.limits.substr(at, end - at);
    at = end + 1;
    const size_t eq = item.find('=');
    const std::string key = item.substr(0, eq);
    double value = 0;
    const std::string text = eq == std::string::npos ? "" : item.substr(eq + 1);
    char* rest = nullptr;
    if (!text.empty()) value = std::strtod(text.c_str(), &rest);
    if (text.empty() || rest == nullptr || *rest != '\0')
      return Status::errorf("--limits '{}': expected KEY=NUMBER", item);
    auto whole = [&](auto& out) -> Status {
      if (value != std::floor(value) || value < 0 || value > 2147483647.0)
        return Status::errorf("--limits '{}': the value must be a whole number", item);
      out = static_cast<std::remove_reference_t<decltype(out)>>(value);
      return Status::ok();
    };
    if (key == "max_connections")
      KILN_TRY(whole(l.max_connections));
    else if (key == "max_connections_per_client")
      KILN_TRY(whole(l.max_connections_per_client));
    else if (key == "keep_alive_max")
      KILN_TRY(whole(l.keep_alive_max_requests));
    else if (key == "max_header_kib")
      KILN_TRY(whole(v.max_header_kib));
    else if (key == "max_body_kib")
      KILN_TRY(whole(v.max_body_kib));
    else if (key == "max_response_kib")
      KILN_TRY(whole(v.max_response_kib));
    else if (key == "header_timeout")
      v.header_timeout_s = value;
    else if (key == "body_timeout")
      v.body_timeout_s = value;
    else if (key == "idle_timeout")
      v.idle_timeout_s = value;
    else if (key == "write_timeout")
      v.write_timeout_s = value;
    else
      return Status::errorf(
          "--limits '{}': KEY must be one of max_connections, max_connections_per_client, "
          "header_timeout, body_timeout, idle_timeout, keep_alive_max, write_timeout, "
          "max_header_kib, max_body_kib, max_response_kib",
          item);
  }
  KILN_TRY(kib("max_body_kib", v.max_body_kib, l.max_body_bytes));
  KILN_TRY(kib("max_header_kib", v.max_header_kib, l.max_header_bytes));
  KILN_TRY(kib("max_response_kib", v.max_response_kib, l.max_response_bytes));
  KILN_TRY(ms("header_timeout", v.header_timeout_s, l.header_timeout_ms));
  KILN_TRY(ms("body_timeout", v.body_timeout_s, l.body_timeout_ms));
  KILN_TRY(ms("idle_timeout", v.idle_timeout_s, l.idle_timeout_ms));
  KILN_TRY(ms("write_timeout", v.write_timeout_s, l.write_timeout_ms));
  if (l.max_connections < 1 || l.max_connections > (1 << 20))
    return Status::errorf("--limits max_connections={} must be in [1, 2^20]", l.max_connections);
  if (l.max_connections_per_client < 1)
    return Status::errorf("--limits max_connections_per_client={} must be >= 1",
                          l.max_connections_per_client);
  if (l.keep_alive_max_requests < 1)
    return Status::errorf("--limits keep_alive_max={} must be >= 1", l.keep_alive_max_requests);
  // Every connection is a file descriptor: raise the soft limit to the hard one if needed, and
  // refuse a cap the process could never hold (accept would fail instead, in a busy loop).
  rlimit fds{};
  if (::getrlimit(RLIMIT_NOFILE, &fds) == 0) {
    const rlim_t want = rlim_t(l.max_connections) + 256;  // model files, threads, listeners
    if (fds.rlim_cur < want && fds.rlim_cur < fds.rlim_max) {
      fds.rlim_cur = std::min(want, fds.rlim_max);
      ::setrlimit(RLIMIT_NOFILE, &fds);
    }
    if (fds.rlim_cur < want)
      return Status::errorf(
          "--limits max_connections={} needs {} file descriptors and the limit is {} (ulimit -n)",
          l.max_connections, want, uint64_t(fds.rlim_cur));
  }
  return Status::ok();
}

// `--role prefill`: the prefill node (apps/kiln/prefill_node.h), without HTTP.
Status serve_prefill_role(const ServeOptions& o, const Config& cfg, const sigset_t& sigs) {
  PrefillNodeOptions p;
  p.model_path = o.server.model_path;
  p.host = o.server.host;
  p.transport = o.kv_transport;
  p.port = o.kv_port;
  p.chunk = o.server.prefill_chunk;
  p.timeout_ms = o.prefill_timeout_ms;
  return run_prefill_node(p, cfg, sigs);
}

Status serve(ServeOptions o) {
  KILN_ASSIGN_OR_RETURN(Config cfg, load_config(*o.config));
  if (auto lvl = parse_log_level(cfg.log_level)) set_log_level(*lvl);
  KILN_ASSIGN_OR_RETURN(o.server.model_path, resolve_model_path(o.model, cfg));
  if (o.server.port < 0 || o.server.port > 65535)
    return Status::errorf("--port {} must be in [0, 65535]", o.server.port);
  if (o.server.n_parallel < 1)
    return Status::errorf("--parallel {} must be >= 1", o.server.n_parallel);
  if (o.server.n_ctx < 0) return Status::errorf("--ctx-size {} must be >= 0", o.server.n_ctx);
  if (o.server.prefill_chunk < 1)
    return Status::errorf("--prefill-chunk {} must be >= 1", o.server.prefill_chunk);
  if (o.server.max_queue < 0)
    return Status::errorf("--max-queue {} must be >= 0", o.server.max_queue);
  if (o.server.draft_ngram < 0 || o.server.draft_ngram > GenerationParams::kMaxDraft)
    return Status::errorf("--draft-ngram {} must be in [0, {}]", o.server.draft_ngram,
                          GenerationParams::kMaxDraft);
  const int spec_modes = (o.server.draft_ngram > 0) + !o.server.dflash.empty() + o.server.spec_mtp;
  if (spec_modes > 1) return Status::error("give one of --draft-ngram, --dflash and --spec-mtp");
  if (o.server.draft_n < 1 || o.server.draft_n > GenerationParams::kMaxDraft)
    return Status::errorf("--draft-n {} must be in [1, {}]", o.server.draft_n,
                          GenerationParams::kMaxDraft);
  KILN_ASSIGN_OR_RETURN(o.server.cors_origins, cors_origins(o.cors));
  KILN_TRY(sampling_defaults(o.temperature, o.sampling, o.server.sampling));
  KILN_TRY(server_limits(o, o.server.limits));
  // The same runtime as kiln run: --device, --threads, --tensor-parallel, expert budgets.
  KILN_ASSIGN_OR_RETURN(o.server.engine, engine_options(cfg));
  if (o.role != "standalone" && o.role != "prefill" && o.role != "decode")
    return Status::errorf("--role '{}' must be standalone, prefill or decode", o.role);
  if (o.prefill_timeout_ms <= 0)
    return Status::errorf("--prefill-timeout-ms {} must be > 0", o.prefill_timeout_ms);
  if (o.role == "decode") {
    if (o.prefill_peer.empty())
      return Status::error("--role decode needs --prefill-peer HOST:PORT");
    KILN_ASSIGN_OR_RETURN(transfer::TransportKind kind,
                          transfer::transport_from_name(o.kv_transport));
    KILN_ASSIGN_OR_RETURN(auto hp, transfer::parse_host_port(o.prefill_peer));
    auto peer = std::make_shared<transfer::PrefillPeer>(transfer::tcp_or_ucx_peer(
        kind, hp.first, hp.second, transfer::Millis(o.prefill_timeout_ms)));
    // Fails open: a failed remote prefill leaves the slot empty and it prefills locally.
    o.server.remote_prefill = [peer](Session& s, std::span<const int32_t> head) {
      auto link = peer->connect();
      transfer::RemoteStats rs;
      Status st =
          link ? transfer::remote_prefill(**link, s, head, peer->timeout, &rs) : link.status();
      if (!st)
        log_notice("remote prefill from {} failed ({}); prefilling locally", peer->name,
                   st.message());
      else
        log_info("remote prefill of {} tokens from {}: {} bytes in {:.3f} s", head.size(),
                 peer->name, rs.bytes, rs.seconds);
      return st.is_ok();
    };
  } else if (!o.prefill_peer.empty()) {
    return Status::error("--prefill-peer needs --role decode");
  }

  // Signals go to sigwait below, not to whichever server thread happens to run.
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGTERM);
  sigaddset(&sigs, SIGINT);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  if (o.role == "prefill") return serve_prefill_role(o, cfg, sigs);

  // A file that is not a readable GGUF fails here, in one line, before anything listens (the
  // full load, which can take minutes, runs after: /health says 503 meanwhile).
  if (auto f = GgufFile::open(o.server.model_path); !f)
    return f.status().context(fmt::format("loading model '{}'", o.server.model_path));
  server::HttpServer srv(o.server);
  KILN_TRY(srv.start());
  fmt::print(stderr, "kiln serve: listening on http://{}:{}\n", o.server.host, srv.port());
  std::fflush(stderr);
  // SIGTERM/SIGINT are taken by this thread from now on, also while the model loads (a load
  // can take minutes): during the load the process exits at once, 0 (the load only maps and
  // reads, nothing is half-written); afterwards in-flight requests end first (stop()).
  enum Phase : int { kLoading, kServing, kLeaving };
  std::atomic<int> phase{kLoading};
  std::thread watcher([&] {
    int sig = 0;
    sigwait(&sigs, &sig);
    if (phase.load() == kLeaving) return;  // woken by serve() itself
    const char* name = sig == SIGTERM ? "SIGTERM" : "SIGINT";
    if (phase.load() == kLoading) {
      fmt::print(stderr, "kiln serve: {} received while loading; exiting\n", name);
      std::fflush(stderr);
      std::_Exit(0);
    }
    fmt::print(stderr, "kiln serve: {} received, shutting down\n", name);
    srv.stop();
  });
  if (Status st = srv.load(); !st) {
    phase.store(kLeaving);
    pthread_kill(watcher.native_handle(), SIGTERM);  // ends its sigwait
    watcher.join();
    return st;
  }
  phase.store(kServing);
  fmt::print(stderr, "kiln serve: model {} ready ({} slots)\n", srv.model_name(),
             o.server.n_parallel);
  std::fflush(stderr);
  srv.wait();
  watcher.join();
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
  cmd->add_option("-c,--ctx-size", o->server.n_ctx,
                  "context per slot (default min(training, 4096))");
  cmd->add_option("--prefill-chunk", o->server.prefill_chunk,
                  "prompt tokens per slot step (default 256)");
  cmd->add_option("--max-queue", o->server.max_queue, "waiting requests before 503 (default 64)");
  cmd->add_option("--draft-ngram", o->server.draft_ngram,
                  "speculative decoding with up to N n-gram (prompt lookup) drafts per step "
                  "(default 0: off; model drafters: --dflash DRAFTER or --spec-mtp, --draft-n N)");
  // Listed in --draft-ngram's line, so --help stays at 30 options; kiln run's spellings.
  cmd->add_option("--dflash", o->server.dflash,
                  "speculative decoding with this DFlash block drafter (GGUF arch 'dflash')")
      ->group("");
  cmd->add_flag("--spec-mtp", o->server.spec_mtp,
                "speculative decoding with the model's own NextN (MTP) layers")
      ->group("");
  cmd->add_option("--draft-n", o->server.draft_n,
                  "model drafter: draft tokens per step (default 4)")
      ->group("");
  cmd->add_option("--api-key", o->server.api_key, "require 'Authorization: Bearer KEY'");
  // Connection and size limits (docs/server.md, "Limits"): one option, as --sampling, so
  // --help stays a screen. --max-body-kib is kept, unlisted, for scripts that set it.
  cmd->add_option(
      "--limits", o->limits,
      "connection/size limits, e.g. max_connections=256,header_timeout=5 (docs/server.md)");
  cmd->add_option("--max-body-kib", o->max_body_kib, "request body limit in KiB (default 1024)")
      ->group("");
  cmd->add_option("--cors", o->cors,
                  "allow browser pages of these origins (comma-separated, or *) to call the API "
                  "(default: off)");
  cmd->add_option("--alias", o->server.alias,
                  "the model's name in responses and /v1/models (default: the file's stem)");
  cmd->add_option("--chat-template-file", o->server.chat_template_file,
                  "a Jinja chat template used instead of the GGUF's tokenizer.chat_template");
  // Defaults for requests that leave a field out (OpenAI's unless set); a request's own value
  // always wins.
  cmd->add_option("--temp", o->temperature, "default temperature, 0 .. 2; 0: greedy (default 1)");
  cmd->add_option("--sampling", o->sampling,
                  "other request defaults, e.g. top_k=40,min_p=0.05 (top_k, top_p, min_p, "
                  "repeat_penalty, presence_penalty, frequency_penalty)");
  cmd->add_option("--role", o->role, "standalone (default), prefill or decode (docs/kvpack.md)");
  cmd->add_option("--prefill-peer", o->prefill_peer, "decode role: HOST:PORT of the prefill node");
  cmd->add_option("--kv-port", o->kv_port, "prefill role: port for decode nodes (default 7070)");
  cmd->add_option("--kv-transport", o->kv_transport, "tcp or ucx (default tcp)");
  cmd->add_option("--prefill-timeout-ms", o->prefill_timeout_ms,
                  "a stalled peer is given up after this long (default 30000)");
  o->config = add_config_options(cmd);
  cmd->callback([o, &exit_code] {
    if (Status s = serve(*o); !s) {
      fmt::print(stderr, "kiln serve: {}\n", s.message());
      exit_code = 1;
    }
  });
}

}  // namespace kiln::app
