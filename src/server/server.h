// server/server.h: the OpenAI-compatible HTTP server (cpp-httplib): routes, SSE streaming,
// API key, metrics, and the lifecycle start (listen, /health 503) -> load (model ready) ->
// stop (cancel in-flight requests, close the socket).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/status.h"
#include "engine/runtime.h"
#include "server/api.h"
#include "server/limits.h"

namespace kiln {
class Model;
class Session;
}  // namespace kiln

namespace kiln::server {

struct ServerOptions {
  std::string model_path;
  std::string host = "127.0.0.1";
  int port = 8080;         // 0: an ephemeral port (see HttpServer::port())
  int32_t n_parallel = 4;  // slots
  int32_t n_ctx = 0;       // per slot; 0: min(training context, 4096)
  int32_t prefill_chunk = 256;
  int32_t max_queue = 64;  // waiting requests beyond the slots; more get 503
  std::string api_key;     // non-empty: /v1/*, /tokenize, /detokenize need "Bearer <key>"
  int http_threads = 0;    // 0: n_parallel + max_queue + 8 (streams hold a thread each)
  // Connections, timeouts and sizes (server/limits.h); each is a `kiln serve` option.
  ServerLimits limits;
  // `--role decode`: prompts' KV comes from a prefill node (SchedulerConfig::remote_prefill).
  std::function<bool(Session&, std::span<const int32_t>)> remote_prefill;
  int32_t draft_ngram = 0;  // n-gram draft tokens per decode step (SchedulerConfig); 0: off
  // Model drafters (SchedulerConfig::make_drafter), one per slot, draft_n tokens per step: a
  // DFlash drafter GGUF (`--dflash`), or the model's own NextN layers (`--spec-mtp`).
  std::string dflash;
  bool spec_mtp = false;
  int32_t draft_n = 4;
  std::string alias;               // the model's name in responses; "": the file's stem
  std::string chat_template_file;  // a .jinja file used instead of the GGUF's template
  SamplingDefaults sampling;       // what requests that leave a sampling field out get
  // Largest `n` (choices) a request may ask for; 0: n_parallel (choices decode side by side,
  // one slot each, so more than the slots would only queue behind themselves).
  int32_t max_n = 0;
  // Origins whose browser pages may call the API (CORS); "*": any; empty: CORS off.
  std::vector<std::string> cors_origins;
  // How the model is opened (engine/runtime.h): device, threads, tensor parallelism, expert
  // tiers; device_sampling goes to the scheduler.
  EngineOptions engine;
};

class HttpServer {
 public:
  explicit HttpServer(ServerOptions opt);
  ~HttpServer();  // stop()
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds and starts serving on a background thread; until load() succeeds /health and every
  // model route answer 503. Errors: the address cannot be bound.
  Status start();
  // Loads the model, tokenizer and chat template and starts the scheduler. Errors name the file.
  Status load();
  // Cancels queued and running requests (streams end with finish_reason "cancelled" and
  // [DONE]), stops accepting and joins the server thread. Idempotent; safe from any thread
  // but a request handler.
  void stop();
  // Blocks until the server thread ends (after stop()).
  void wait();

  int port() const;  // the bound port, valid after start()
  const std::string& model_name() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::server
