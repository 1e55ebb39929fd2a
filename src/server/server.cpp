// server/server.cpp: routes of the OpenAI-compatible server (see server.h). Requests are
// parsed and validated in api.cpp, turned into token ids here (chat template from the GGUF,
// or a plain fallback), checked against the context, and only then submitted to the
// scheduler. Streams are SSE over chunked transfer; a client that goes away cancels its
// request, which frees the slot at the scheduler's next step.
#include "server/server.h"

#include <httplib.h>
#include <signal.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <random>
#include <thread>

#include "core/counters.h"
#include "engine/chat.h"
#include "engine/constrained.h"
#include "engine/dflash_drafter.h"
#include "engine/mtp_drafter.h"
#include "engine/runtime.h"
#include "engine/scheduler.h"
#include "engine/session.h"
#include "engine/tool_calls.h"
#include "format/gguf.h"
#include "grammar/grammar.h"
#include "grammar/matcher.h"
#include "server/api.h"
#include "server/auth.h"
#include "server/chat_page.h"
#include "server/connections.h"
#include "tokenizer/jinja/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace kiln::server {

using json = nlohmann::json;
using namespace std::chrono_literals;

namespace {

int64_t unix_seconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// The socket of the connection a request came on, or -1. cpp-httplib 0.11 hands a handler no
// connection, and a non-streaming request whose client has gone must still stop generating:
// the connection is found by its two addresses among this process's sockets. Safe because
// httplib keeps that socket open until the handler returns, so the fd cannot be reused while
// the handler polls it.
int connection_fd(const httplib::Request& req) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd", ec)) {
    int fd = -1;
    try {
      fd = std::stoi(entry.path().filename().string());
    } catch (const std::exception&) {
      continue;
    }
    sockaddr_storage local{}, peer{};
    socklen_t ll = sizeof local, pl = sizeof peer;
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &ll) != 0) continue;
    if (::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &pl) != 0) continue;
    auto port_of = [](const sockaddr_storage& a) {
      if (a.ss_family == AF_INET)
        return int(ntohs(reinterpret_cast<const sockaddr_in&>(a).sin_port));
      if (a.ss_family == AF_INET6)
        return int(ntohs(reinterpret_cast<const sockaddr_in6&>(a).sin6_port));
      return -1;
    };
    if (port_of(local) == req.local_port && port_of(peer) == req.remote_port) return fd;
  }
  return -1;
}

// Whether the peer of `fd` has closed its side (or the socket failed).
bool peer_gone(int fd) {
  if (fd < 0) return false;
  pollfd p{fd, POLLRDHUP, 0};
  return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

void send_error(httplib::Response& res, const ApiError& e) {
  res.status = e.status;
  res.set_content(error_body(e), "application/json");
}

ApiError make_error(int status, std::string msg, std::string type, std::string code) {
  ApiError e;
  e.status = status;
  e.message = std::move(msg);
  e.type = std::move(type);
  e.code = std::move(code);
  return e;
}

}  // namespace

struct HttpServer::Impl {
  explicit Impl(ServerOptions o)
      : opt(std::move(o)),
        http(opt.limits,
             size_t(opt.http_threads > 0 ? opt.http_threads : opt.n_parallel + opt.max_queue + 8)) {
  }

  ServerOptions opt;
  GuardedServer http;  // httplib's request handling over kiln's connection limits
  std::thread thread;
  int port = -1;
  std::string model_name;
  std::atomic<bool> ready{false};
  std::atomic<bool> stopping{false};
  std::atomic<bool> listen_ended{false};  // the listen thread returned
  // Streaming responses whose content provider has not been released: stop() lets them write
  // their last events before httplib stops calling providers (it cuts a stream mid-way).
  std::atomic<int> open_streams{0};
  std::mutex stop_mu;

  // Set once by load() before `ready` is published; read-only afterwards. The scheduler runs
  // on the runtime's backend: declared after it, so destroyed first.
  std::optional<Runtime> rt;
  std::shared_ptr<const Model> model;
  Tokenizer* tok = nullptr;                     // rt's
  std::optional<ChatTemplate> own_template;     // --chat-template-file
  const ChatTemplate* chat_template = nullptr;  // own_template or rt's; nullptr: none
  ToolFormat tool_format = ToolFormat::kNone;   // the template's tool-call format
  bool object_arguments = false;                // the template reads arguments as objects
  std::vector<int32_t> tool_special_ids;        // the format's control tokens, rendered as text
  // The vocabulary view of forced tool calls: tool_special_ids are their text (null: none).
  std::shared_ptr<const grammar::TokenTrie> tool_vocab;
  std::unique_ptr<Scheduler> scheduler;

  std::atomic<uint64_t> n_http_requests{0}, n_http_errors{0}, n_completions{0};
  std::atomic<uint64_t> id_counter{0};

  void routes();
  bool authorized(const httplib::Request& req, httplib::Response& res) const;
  bool check_ready(httplib::Response& res) const;
  // The Access-Control-Allow-Origin value for this request's Origin; "" when not allowed.
  std::string cors_origin(const httplib::Request& req) const;
  void completion(const httplib::Request& req, httplib::Response& res, const std::string& body,
                  bool chat);
  std::optional<ApiError> build_prompt(const CompletionRequest& r, std::vector<int32_t>& ids) const;
  std::optional<ApiError> force_tool_call(CompletionRequest& r,
                                          std::shared_ptr<const grammar::TokenTrie>& vocab) const;
  std::string metrics() const;
};

HttpServer::HttpServer(ServerOptions opt) : impl_(new Impl(std::move(opt))) {
  impl_->model_name = !impl_->opt.alias.empty()
                          ? impl_->opt.alias
                          : std::filesystem::path(impl_->opt.model_path).stem().string();
  if (impl_->model_name.empty()) impl_->model_name = "kiln";
}

HttpServer::~HttpServer() { stop(); }

int HttpServer::port() const { return impl_->port; }
const std::string& HttpServer::model_name() const { return impl_->model_name; }

Status HttpServer::start() {
  Impl& s = *impl_;
  // A peer that closes mid-write must surface as a failed write, not kill the process.
  ::signal(SIGPIPE, SIG_IGN);
  // Threads, timeouts and connection caps are the GuardedServer's (server/connections.h).
  s.routes();
  // cpp-httplib's default sets SO_REUSEPORT, which lets a second server bind a busy port and
  // the kernel split the connections between the two: SO_REUSEADDR only (a restart may reuse
  // a port in TIME_WAIT; a live listener keeps it).
  s.http.set_socket_options([](socket_t sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  if (s.opt.port == 0)
    s.port = s.http.bind_to_any_port(s.opt.host);
  else
    s.port = s.http.bind_to_port(s.opt.host, s.opt.port) ? s.opt.port : -1;
  if (s.port < 0)
    return Status::errorf("port {} in use or not available on {}", s.opt.port, s.opt.host);
  s.http.widen_backlog();
  s.thread = std::thread([&s] {
    s.http.listen_after_bind();
    s.listen_ended.store(true);
  });
  // httplib's stop() does nothing until the listen loop runs, and the loop would then never
  // end: stop() may be called as soon as start() returns (a failed load), so wait for it.
  while (!s.http.is_running() && !s.listen_ended.load()) std::this_thread::sleep_for(1ms);
  return Status::ok();
}

Status HttpServer::load() {
  Impl& s = *impl_;
  auto rt = Runtime::open(s.opt.model_path, s.opt.engine);
  if (!rt) return rt.status();  // its message names the file
  s.rt.emplace(std::move(*rt));
  // Pointers into the runtime only once it sits where it stays.
  if (!s.opt.chat_template_file.empty()) {
    // --chat-template-file replaces the GGUF's template (a fixed or a missing one).
    std::ifstream f(s.opt.chat_template_file, std::ios::binary);
    if (!f)
      return Status::errorf("--chat-template-file '{}' cannot be read", s.opt.chat_template_file);
    const std::string src((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    auto t = ChatTemplate::parse(src);
    if (!t)
      return t.status().context(fmt::format("--chat-template-file '{}'", s.opt.chat_template_file));
    s.own_template.emplace(std::move(*t));
    s.chat_template = &*s.own_template;
  } else {
    KILN_ASSIGN_OR_RETURN(s.chat_template, s.rt->chat_template());
  }
  s.model = s.rt->model();
  s.tok = &s.rt->tokenizer();
  if (s.chat_template != nullptr) {
    s.tool_format = detect_tool_format(s.chat_template->source());
    s.object_arguments = template_wants_object_arguments(*s.chat_template);
    for (std::string_view text : tool_format_special_texts(s.tool_format))
      if (const int32_t id = s.tok->find_token(text); id >= 0) s.tool_special_ids.push_back(id);
  }
  SchedulerConfig cfg;
  cfg.n_slots = s.opt.n_parallel;
  cfg.n_ctx = s.opt.n_ctx;
  cfg.prefill_chunk = s.opt.prefill_chunk;
  cfg.max_queue = s.opt.max_queue;
  cfg.remote_prefill = s.opt.remote_prefill;
  cfg.draft_ngram = s.opt.draft_ngram;
  if (!s.opt.dflash.empty() || s.opt.spec_mtp) {
    if (!s.opt.dflash.empty() && s.opt.spec_mtp)
      return Status::error("give one of --dflash and --spec-mtp");
    cfg.draft_model = s.opt.draft_n;
    Backend& be = s.rt->backend();
    cfg.make_drafter = [model = s.model, &be, dflash = s.opt.dflash, draft_n = s.opt.draft_n](
                           int32_t n_ctx, int32_t max_batch) -> Expected<std::unique_ptr<Drafter>> {
      if (!dflash.empty()) {
        KILN_ASSIGN_OR_RETURN(auto d, DflashDrafter::create(dflash, model, be, n_ctx, max_batch));
        if (draft_n > d->max_draft())
          return Status::errorf(
              "--draft-n {} exceeds the DFlash drafter's block ({} drafts at most)", draft_n,
              d->max_draft());
        return std::unique_ptr<Drafter>(std::move(d));
      }
      KILN_ASSIGN_OR_RETURN(auto d, MtpDrafter::create(model, be, n_ctx, max_batch));
      return std::unique_ptr<Drafter>(std::move(d));
    };
  }
  cfg.device_sampling = s.opt.engine.device_sampling;
  const auto eog = s.tok->eog_ids();
  cfg.eog_ids.assign(eog.begin(), eog.end());
  cfg.grammar_vocab = make_token_trie(*s.tok);  // once per model: every grammar request uses it
  if (!s.tool_special_ids.empty()) s.tool_vocab = make_token_trie(*s.tok, s.tool_special_ids);
  auto sch = Scheduler::create(s.model, s.rt->backend(), cfg);
  if (!sch) return sch.status();
  s.scheduler = std::move(*sch);
  s.ready.store(true, std::memory_order_release);
  return Status::ok();
}

void HttpServer::stop() {
  Impl& s = *impl_;
  std::lock_guard lk(s.stop_mu);
  s.stopping.store(true);
  // Streams see their requests end (cancelled) and finish; then the socket closes.
  if (s.scheduler) s.scheduler->shutdown();
  if (s.thread.joinable()) {
    // The scheduler has queued every stream's end (cancelled); httplib stops calling content
    // providers once stop() runs, so give the open streams a bounded time to write it and
    // [DONE] (a client that reads nothing holds one no longer than this).
    const auto until = std::chrono::steady_clock::now() + 2s;
    while (s.open_streams.load() > 0 && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(5ms);
    s.http.stop();
    s.thread.join();
  }
}

void HttpServer::wait() {
  // listen_after_bind returns once stop() ran; stop() joins. Poll so a signal thread can stop.
  while (!impl_->stopping.load()) std::this_thread::sleep_for(50ms);
  std::lock_guard lk(impl_->stop_mu);
}

bool HttpServer::Impl::authorized(const httplib::Request& req, httplib::Response& res) const {
  if (opt.api_key.empty()) return true;
  if (bearer_matches(req.get_header_value("Authorization"), opt.api_key)) return true;
  send_error(res, make_error(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                             "invalid_request_error", "invalid_api_key"));
  return false;
}

std::string HttpServer::Impl::cors_origin(const httplib::Request& req) const {
  const std::string origin = req.get_header_value("Origin");
  if (origin.empty()) return "";
  for (const std::string& allowed : opt.cors_origins) {
    if (allowed == "*") return "*";
    if (allowed == origin) return origin;
  }
  return "";
}

bool HttpServer::Impl::check_ready(httplib::Response& res) const {
  if (ready.load(std::memory_order_acquire) && !stopping.load()) return true;
  send_error(
      res, make_error(503, stopping.load() ? "the server is shutting down" : "the model is loading",
                      "server_error", stopping.load() ? "shutting_down" : "loading"));
  return false;
}

std::optional<ApiError> HttpServer::Impl::build_prompt(const CompletionRequest& r,
                                                       std::vector<int32_t>& ids) const {
  const Tokenizer& t = *tok;
  if (!r.chat) {
    if (!r.prompt_ids.empty()) {
      for (size_t i = 0; i < r.prompt_ids.size(); ++i)
        if (r.prompt_ids[i] >= t.n_vocab()) {
          ApiError e =
              make_error(400,
                         fmt::format("token id {} at prompt[{}] is outside the vocabulary [0, {})",
                                     r.prompt_ids[i], i, t.n_vocab()),
                         "invalid_request_error", "invalid_value");
          e.param = "prompt";
          return e;
        }
      ids = r.prompt_ids;
    } else {
      ids = t.encode(r.prompt, /*add_special=*/true, /*parse_special=*/false);
    }
    return std::nullopt;
  }
  // Tools reach the template only where the reply can be parsed back into calls: offering
  // them to a model whose format kiln cannot read would return calls as plain text.
  const bool offer_tools = !r.tools.is_null() && r.tool_choice != ToolChoice::kNone;
  const bool history_tools = std::any_of(r.messages.begin(), r.messages.end(), [](const auto& m) {
    return !m.tool_calls.empty() || m.role == "tool";
  });
  auto tools_error = [](std::string msg) {
    ApiError e = make_error(400, std::move(msg), "invalid_request_error", "unsupported_value");
    e.param = "tools";
    return e;
  };
  if ((offer_tools || history_tools) && chat_template == nullptr)
    return tools_error(
        "'tools' and tool messages need a chat template, and this model's file has none");
  if (offer_tools && tool_format == ToolFormat::kNone)
    return tools_error(
        "'tools': this model's chat template writes tool calls in a format kiln does not "
        "parse (it reads llama3, hermes, qwen3-xml, glm, mistral, deepseek, gpt-oss); send "
        "tool_choice 'none' to chat without them");
  ChatPromptOptions po;
  if (offer_tools) po.tools = r.tools;
  po.object_arguments = object_arguments;
  auto prompt = chat_prompt(t, chat_template, r.messages, po);
  if (!prompt) {
    ApiError e = make_error(400, prompt.error(), "invalid_request_error", "template_error");
    e.param = "messages";
    return e;
  }
  ids = std::move(*prompt);
  return std::nullopt;
}

// tool_choice "required" / a named function: the grammar of a reply made of calls, in the
// template's format, compiled into r.grammar.
std::optional<ApiError> HttpServer::Impl::force_tool_call(
    CompletionRequest& r, std::shared_ptr<const grammar::TokenTrie>& vocab) const {
  if (r.tool_choice != ToolChoice::kRequired && r.tool_choice != ToolChoice::kFunction)
    return std::nullopt;
  auto fail = [](std::string msg) {
    ApiError e = make_error(400, std::move(msg), "invalid_request_error", "unsupported_value");
    e.param = "tool_choice";
    return e;
  };
  auto gbnf = tool_call_gbnf(tool_format, chat_template->source(), r.tools,
                             r.tool_choice == ToolChoice::kFunction ? r.tool_choice_name : "",
                             r.parallel_tool_calls);
  if (!gbnf) return fail("'tool_choice': " + gbnf.status().message());
  auto g = grammar::Grammar::parse(*gbnf);
  if (!g) return fail("'tool_choice': " + g.status().message());
  r.grammar = std::move(*g);
  vocab = tool_vocab;
  return std::nullopt;
}

namespace {

// One request's state while its response is produced (shared with the stream provider).
struct Job {
  std::shared_ptr<GenStream> stream;
  const Tokenizer* tok = nullptr;
  bool chat = false, include_usage = false;
  int32_t top_logprobs = -1;
  std::string id, model;
  int64_t created = 0;
  int32_t n_prompt = 0;
  StopMatcher stop;
  std::string text;                    // released text
  json logprobs_chat = json::array();  // chat: logprobs.content entries
  json lp_tokens = json::array(), lp_values = json::array(), lp_top = json::array(),
       lp_offsets = json::array();  // completions
  bool done = false, sent_role = false;
  std::string finish = "stop";
  int32_t n_generated = 0;
  int32_t n_cached = 0;                         // prompt tokens whose KV rows the slot already held
  int32_t index = 0;                            // the choice's index (n > 1)
  bool ended = false;                           // the scheduler's end event was handled
  double prompt_ms = 0, predicted_ms = 0;       // the scheduler's timings
  int32_t n_drafted = 0, n_draft_accepted = 0;  // speculative decoding (timings draft_n...)
  std::string error;                            // a kError end: what went wrong
  // Tool calls (chat with tools offered): the reply is parsed in this format; the format's
  // control tokens are rendered as text so the parser sees them.
  ToolFormat tool_format = ToolFormat::kNone;
  std::span<const int32_t> tool_special_ids;
  std::optional<ToolCallStream> tool_stream;
  bool parallel_tool_calls = true;
  std::mt19937_64 rng{std::random_device{}()};

  explicit Job(std::vector<std::string> stops) : stop(std::move(stops)) {}

  json bytes_of(const std::string& s) const {
    json b = json::array();
    for (unsigned char c : s) b.push_back(int(c));
    return b;
  }
  // Records one token; returns the text it releases.
  std::string on_token(const GenEvent& e) {
    const bool special =
        std::find(tool_special_ids.begin(), tool_special_ids.end(), e.id) != tool_special_ids.end();
    const std::string piece = tok->token_to_piece(e.id, special);
    if (top_logprobs >= 0) {
      if (chat) {
        json top = json::array();
        for (const TokenLogprob& t : e.top) {
          const std::string p = tok->token_to_piece(t.id, false);
          top.push_back({{"token", p}, {"logprob", t.logprob}, {"bytes", bytes_of(p)}});
        }
        logprobs_chat.push_back({{"token", piece},
                                 {"logprob", e.logprob},
                                 {"bytes", bytes_of(piece)},
                                 {"top_logprobs", top}});
      } else {
        json top = json::object();
        for (const TokenLogprob& t : e.top) top[tok->token_to_piece(t.id, false)] = t.logprob;
        lp_tokens.push_back(piece);
        lp_values.push_back(e.logprob);
        lp_top.push_back(top);
        lp_offsets.push_back(text.size());
      }
    }
    std::string out = stop.push(piece);
    text += out;
    if (stop.stopped()) {
      finish = "stop";
      done = true;
      stream->cancel();  // the slot frees at the next step
    }
    return out;
  }
  void on_done(const GenEvent& e) {
    n_generated = e.n_generated;
    n_cached = e.n_reused;
    prompt_ms = e.prompt_ms;
    predicted_ms = e.predicted_ms;
    n_drafted = e.n_drafted;
    n_draft_accepted = e.n_draft_accepted;
    error = e.error;
    if (!done) {
      finish = e.finish == FinishReason::kLength ? "length"
               : e.finish == FinishReason::kStop ? "stop"
                                                 : finish_reason_name(e.finish);
      std::string rest = stop.flush();
      text += rest;
      last_flush = std::move(rest);
    }
    done = true;
  }
  std::string last_flush;

  // llama.cpp's `timings` of this choice: prompt tokens evaluated (not reused) and the time
  // to the first token; tokens generated and the time after the first.
  json timings() const {
    return timings_json(n_prompt - n_cached, n_cached, prompt_ms, n_generated, predicted_ms,
                        n_drafted, n_draft_accepted);
  }
  // draft_n / draft_n_accepted as llama-server reports them: only when drafts were verified.
  static json timings_json(int64_t prompt_n, int64_t cache_n, double prompt_ms, int64_t predicted_n,
                           double predicted_ms, int64_t draft_n, int64_t draft_n_accepted) {
    auto per_token = [](double ms, int64_t n) { return n > 0 ? ms / double(n) : 0.0; };
    auto per_second = [](double ms, int64_t n) { return ms > 0 ? 1e3 * double(n) / ms : 0.0; };
    json t = {{"cache_n", cache_n},
              {"prompt_n", prompt_n},
              {"prompt_ms", prompt_ms},
              {"prompt_per_token_ms", per_token(prompt_ms, prompt_n)},
              {"prompt_per_second", per_second(prompt_ms, prompt_n)},
              {"predicted_n", predicted_n},
              {"predicted_ms", predicted_ms},
              {"predicted_per_token_ms", per_token(predicted_ms, predicted_n)},
              {"predicted_per_second", per_second(predicted_ms, predicted_n)}};
    if (draft_n > 0) {
      t["draft_n"] = draft_n;
      t["draft_n_accepted"] = draft_n_accepted;
    }
    return t;
  }
  json logprobs_json() const {
    if (top_logprobs < 0) return nullptr;
    if (chat) return {{"content", logprobs_chat}};
    return {{"tokens", lp_tokens},
            {"token_logprobs", lp_values},
            {"top_logprobs", lp_top},
            {"text_offset", lp_offsets}};
  }
  // A streamed chunk carrying `delta` text (and the finish reason at the end).
  json chunk(const std::string& delta, const char* finish_reason, bool with_logprobs) {
    json choice = {{"index", index}};
    if (chat) {
      json d = json::object();
      if (!sent_role) {
        d["role"] = "assistant";
        sent_role = true;
      }
      if (!delta.empty() || !finish_reason) d["content"] = delta;
      choice["delta"] = d;
    } else {
      choice["text"] = delta;
    }
    choice["logprobs"] = with_logprobs ? logprobs_json() : json(nullptr);
    choice["finish_reason"] = finish_reason ? json(finish_reason) : json(nullptr);
    json c = {{"id", id},
              {"object", chat ? "chat.completion.chunk" : "text_completion"},
              {"created", created},
              {"model", model},
              {"choices", json::array({choice})}};
    if (include_usage) c["usage"] = nullptr;
    return c;
  }
  json usage_chunk(json usage) const {
    return {{"id", id},
            {"object", chat ? "chat.completion.chunk" : "text_completion"},
            {"created", created},
            {"model", model},
            {"choices", json::array()},
            {"usage", std::move(usage)}};
  }
  bool tools_on() const { return tool_format != ToolFormat::kNone; }
  // OpenAI's call ids: "call_" and 24 letters or digits; Mistral's templates demand exactly 9.
  std::string call_id() {
    static constexpr std::string_view kAlnum =
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    const bool mistral = tool_format == ToolFormat::kMistral;
    std::string out = mistral ? "" : "call_";
    for (int i = 0; i < (mistral ? 9 : 24); ++i) out += kAlnum[rng() % kAlnum.size()];
    return out;
  }
  // The reply's calls with ids, cut to one when parallel calls are off; sets the finish
  // reason "tool_calls" for a reply that ended on its own.
  std::vector<ToolCall> take_calls(ToolReply& reply) {
    std::vector<ToolCall> calls = std::move(reply.tool_calls);
    if (!parallel_tool_calls && calls.size() > 1) calls.resize(1);
    for (ToolCall& c : calls)
      if (c.id.empty()) c.id = call_id();
    if (!calls.empty() && finish == "stop") finish = "tool_calls";
    return calls;
  }
  static json tool_calls_json(const std::vector<ToolCall>& calls) {
    json out = json::array();
    for (size_t i = 0; i < calls.size(); ++i) {
      json c = {{"id", calls[i].id},
                {"type", "function"},
                {"function", {{"name", calls[i].name}, {"arguments", calls[i].arguments}}}};
      out.push_back(std::move(c));
    }
    return out;
  }
  // The non-streamed chat message.
  json message() {
    json m = {{"role", "assistant"}, {"content", text}};
    if (!tools_on()) return m;
    ToolReply reply = parse_tool_reply(tool_format, text);
    const std::vector<ToolCall> calls = take_calls(reply);
    m["content"] = calls.empty() || !reply.content.empty() ? json(reply.content) : json(nullptr);
    if (!reply.reasoning.empty()) m["reasoning_content"] = reply.reasoning;
    if (!calls.empty()) m["tool_calls"] = tool_calls_json(calls);
    return m;
  }
  // One streamed piece of a reply with tools offered, as a chunk (null: a call dropped by
  // parallel_tool_calls false). A call's first delta has its index, id, type and name, with
  // all its arguments for a call parsed whole, else none (gpt-oss): later deltas then carry
  // its index and more of its arguments.
  int32_t n_calls_streamed = 0;
  json delta_chunk(const ToolStreamDelta& t) {
    using Kind = ToolStreamDelta::Kind;
    if (t.kind == Kind::kContent) return chunk(t.text, nullptr, true);
    const bool calls = t.kind == Kind::kCallStart || t.kind == Kind::kArguments;
    if (calls && !parallel_tool_calls && t.index > 0) return nullptr;
    json d = json::object();
    if (!sent_role) d["role"] = "assistant";
    if (t.kind == Kind::kReasoning) {
      d["reasoning_content"] = t.text;
    } else if (t.kind == Kind::kCallStart) {
      ++n_calls_streamed;
      d["tool_calls"] =
          json::array({{{"index", t.index},
                        {"id", t.id.empty() ? call_id() : t.id},
                        {"type", "function"},
                        {"function", {{"name", t.text}, {"arguments", t.arguments}}}}});
    } else {
      d["tool_calls"] = json::array({{{"index", t.index}, {"function", {{"arguments", t.text}}}}});
    }
    json c = chunk("", "", true);
    c["choices"][0]["delta"] = std::move(d);
    c["choices"][0]["finish_reason"] = nullptr;
    return c;
  }
  void clear_logprobs() {
    logprobs_chat = json::array();
    lp_tokens = lp_values = lp_top = lp_offsets = json::array();
  }
};

// The request's usage over its choices: the prompt once, every choice's tokens.
json usage_of(const std::vector<std::shared_ptr<Job>>& jobs) {
  int32_t generated = 0;
  for (const auto& j : jobs) generated += j->n_generated;
  const Job& first = *jobs[0];
  return {{"prompt_tokens", first.n_prompt},
          {"completion_tokens", generated},
          {"total_tokens", first.n_prompt + generated},
          {"prompt_tokens_details", {{"cached_tokens", first.n_cached}}}};
}

// The request's timings: choices run side by side, so tokens add up and times are the
// longest choice's.
json timings_of(const std::vector<std::shared_ptr<Job>>& jobs) {
  int64_t prompt_n = 0, cache_n = 0, predicted_n = 0, draft_n = 0, draft_n_accepted = 0;
  double prompt_ms = 0, predicted_ms = 0;
  for (const auto& j : jobs) {
    draft_n += j->n_drafted;
    draft_n_accepted += j->n_draft_accepted;
    prompt_n += j->n_prompt - j->n_cached;
    cache_n += j->n_cached;
    predicted_n += j->n_generated;
    prompt_ms = std::max(prompt_ms, j->prompt_ms);
    predicted_ms = std::max(predicted_ms, j->predicted_ms);
  }
  return Job::timings_json(prompt_n, cache_n, prompt_ms, predicted_n, predicted_ms, draft_n,
                           draft_n_accepted);
}

}  // namespace

void HttpServer::Impl::completion(const httplib::Request& req, httplib::Response& res,
                                  const std::string& body, bool chat) {
  if (!authorized(req, res) || !check_ready(res)) return;
  const int32_t n_ctx = scheduler->n_ctx();
  Limits limits;
  limits.max_tokens = n_ctx;
  limits.max_n = opt.max_n > 0 ? opt.max_n : opt.n_parallel;
  auto parsed = parse_completion_request(body, chat, limits, opt.sampling);
  if (auto* e = std::get_if<ApiError>(&parsed)) return send_error(res, *e);
  CompletionRequest& r = std::get<CompletionRequest>(parsed);

  std::vector<int32_t> ids;
  if (auto e = build_prompt(r, ids)) return send_error(res, *e);
  std::shared_ptr<const grammar::TokenTrie> grammar_vocab;  // null: the scheduler's
  if (auto e = force_tool_call(r, grammar_vocab)) return send_error(res, *e);
  const int64_t n_prompt = static_cast<int64_t>(ids.size());
  if (n_prompt == 0)
    return send_error(res, make_error(400, "the prompt tokenized to nothing",
                                      "invalid_request_error", "invalid_value"));
  if (n_prompt >= n_ctx)
    return send_error(res, make_error(400,
                                      fmt::format("the prompt has {} tokens; the context holds {} "
                                                  "(at least one must be left to generate)",
                                                  n_prompt, n_ctx),
                                      "invalid_request_error", "context_length_exceeded"));
  if (r.max_tokens < 0)
    r.max_tokens = static_cast<int32_t>(n_ctx - n_prompt);
  else if (n_prompt + r.max_tokens > n_ctx + 1)  // the last sampled token needs no KV row
    return send_error(
        res, make_error(400,
                        fmt::format("the prompt has {} tokens and max_tokens is {}: "
                                    "{} exceeds the context of {}",
                                    n_prompt, r.max_tokens, n_prompt + r.max_tokens, n_ctx),
                        "invalid_request_error", "context_length_exceeded"));

  GenerationParams p;
  p.prompt = std::move(ids);
  p.max_tokens = r.max_tokens;
  p.top_logprobs = r.top_logprobs;
  p.sampling.temperature = r.temperature;  // 0: greedy
  p.sampling.top_p = r.top_p;
  p.sampling.top_k = r.top_k;
  p.sampling.min_p = r.min_p;
  p.sampling.repeat_penalty = r.repeat_penalty;
  p.sampling.presence_penalty = r.presence_penalty;
  p.sampling.frequency_penalty = r.frequency_penalty;
  for (const auto& [id, bias] : r.logit_bias)
    if (id >= model->n_vocab())
      return send_error(
          res, make_error(400,
                          fmt::format("'logit_bias' token id {} is outside the vocabulary [0, {})",
                                      id, model->n_vocab()),
                          "invalid_request_error", "invalid_value"));
  p.sampling.logit_bias = r.logit_bias;
  p.grammar = r.grammar;
  p.grammar_vocab = std::move(grammar_vocab);
  // n choices: n requests of the same prompt, each with its own seed (seed + i when the
  // request gives one), decoding side by side in the scheduler's slots; the prompt is
  // evaluated once and the other choices start from its KV rows (Scheduler::submit_n).
  const int32_t n = r.n;
  const uint64_t seed0 = r.seed ? *r.seed : std::random_device{}();
  std::vector<uint64_t> seeds;
  for (int32_t i = 0; i < n; ++i)
    seeds.push_back(r.seed ? seed0 + static_cast<uint64_t>(i) : std::random_device{}());
  std::vector<std::shared_ptr<Job>> jobs;
  auto cancel_all = [](const std::vector<std::shared_ptr<Job>>& js) {
    for (const auto& j : js) j->stream->cancel();
  };
  const std::string id = fmt::format("{}-{}", chat ? "chatcmpl" : "cmpl", id_counter.fetch_add(1));
  const int64_t created = unix_seconds();
  auto sub = scheduler->submit_n(std::move(p), seeds);
  if (sub.streams.empty()) {
    if (sub.error == Scheduler::SubmitError::kQueueFull) {
      res.set_header("Retry-After", "1");
      return send_error(
          res, make_error(503, "server busy: " + sub.message, "server_error", "queue_full"));
    }
    if (sub.error == Scheduler::SubmitError::kShuttingDown)
      return send_error(res, make_error(503, sub.message, "server_error", "shutting_down"));
    return send_error(res, make_error(400, sub.message, "invalid_request_error", "invalid_value"));
  }
  for (int32_t i = 0; i < n; ++i) {
    auto job = std::make_shared<Job>(r.stop);
    job->index = i;
    job->stream = sub.streams[static_cast<size_t>(i)];
    job->tok = tok;
    job->chat = chat;
    job->include_usage = r.include_usage;
    job->top_logprobs = r.top_logprobs;
    job->id = id;
    job->model = r.model.empty() ? model_name : r.model;
    job->created = created;
    job->n_prompt = static_cast<int32_t>(n_prompt);
    if (chat && !r.tools.is_null() && r.tool_choice != ToolChoice::kNone) {
      job->tool_format = tool_format;
      job->tool_special_ids = tool_special_ids;
      job->tool_stream.emplace(tool_format);
      job->parallel_tool_calls = r.parallel_tool_calls;
    }
    jobs.push_back(std::move(job));
  }
  n_completions.fetch_add(1);

  if (!r.stream) {
    // A client that goes away cancels the request within a poll period, as a stream's does.
    const int fd = connection_fd(req);
    auto checked = std::chrono::steady_clock::now();
    size_t active = jobs.size();
    // One event of one choice; an error ends the whole request.
    auto handle = [&](Job& job, const GenEvent& e) -> bool {
      if (e.kind == GenEvent::Kind::kToken) {
        if (!job.done) job.on_token(e);
        return true;
      }
      job.on_done(e);
      job.ended = true;
      --active;
      return e.finish != FinishReason::kError;
    };
    auto failed = [&](const Job& job) {
      cancel_all(jobs);
      return send_error(res, make_error(500, "generation failed: " + job.error, "server_error",
                                        "internal_error"));
    };
    while (active > 0) {
      // Every event that is ready, then a wait on the first unfinished choice.
      bool any = false;
      for (const auto& job : jobs)
        while (!job->ended) {
          auto e = job->stream->next(0ms);
          if (!e) break;
          any = true;
          if (!handle(*job, *e)) return failed(*job);
        }
      if (const auto now = std::chrono::steady_clock::now(); now - checked >= 100ms) {
        checked = now;
        if (peer_gone(fd)) cancel_all(jobs);  // the scheduler then ends the requests
      }
      if (any || active == 0) continue;
      for (const auto& job : jobs)
        if (!job->ended) {
          // The scheduler always ends a request (shutdown and cancel too).
          if (auto e = job->stream->next(100ms); e && !handle(*job, *e)) return failed(*job);
          break;
        }
    }
    json choices = json::array();
    for (const auto& job : jobs) {
      // The message first: parsing a tool call sets the finish reason.
      json message = chat ? job->message() : json();
      json choice = {{"index", job->index},
                     {"logprobs", job->logprobs_json()},
                     {"finish_reason", job->finish}};
      if (chat)
        choice["message"] = std::move(message);
      else
        choice["text"] = job->text;
      choices.push_back(std::move(choice));
    }
    json body = {{"id", id},
                 {"object", chat ? "chat.completion" : "text_completion"},
                 {"created", created},
                 {"model", jobs[0]->model},
                 {"choices", std::move(choices)},
                 {"usage", usage_of(jobs)},
                 {"timings", timings_of(jobs)}};
    res.set_content(body.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
    return;
  }

  auto send = [](httplib::DataSink& sink, const json& j) {
    const std::string line =
        "data: " + j.dump(-1, ' ', false, json::error_handler_t::replace) + "\n\n";
    return sink.write(line.data(), line.size());
  };
  // One event of one choice written to the stream; false: the client is gone.
  auto on_event = [send](Job& job, const GenEvent& e, httplib::DataSink& sink) -> bool {
    if (e.kind == GenEvent::Kind::kToken) {
      if (job.done) return true;  // after a stop match: drain until the scheduler ends it
      std::string delta = job.on_token(e);
      if (job.tools_on()) {
        // The token's logprobs ride on the first chunk it produces (or an empty one).
        const std::vector<ToolStreamDelta> ds = job.tool_stream->push_deltas(delta);
        bool sent = false;
        for (const ToolStreamDelta& d : ds) {
          const json c = job.delta_chunk(d);
          if (c.is_null()) continue;
          if (!send(sink, c)) return false;
          job.clear_logprobs();
          sent = true;
        }
        if (!sent && job.top_logprobs >= 0 && !send(sink, job.chunk("", nullptr, true)))
          return false;
        job.clear_logprobs();
        return true;
      }
      if (!delta.empty() || job.top_logprobs >= 0) {
        if (!send(sink, job.chunk(delta, nullptr, true))) return false;
        job.clear_logprobs();
      }
      return true;
    }
    job.on_done(e);
    job.ended = true;
    if (e.finish == FinishReason::kError) {
      ApiError err =
          make_error(500, "generation failed: " + e.error, "server_error", "internal_error");
      const std::string line = "data: " + error_body(err) + "\n\n";
      return sink.write(line.data(), line.size());
    }
    bool ok = true;
    json last;
    if (job.tools_on()) {
      // What the stream still holds: the rest of the content, then the calls, then the end.
      std::vector<ToolStreamDelta> ds = job.tool_stream->push_deltas(job.last_flush);
      for (ToolStreamDelta& d : job.tool_stream->finish_deltas()) ds.push_back(std::move(d));
      for (const ToolStreamDelta& d : ds) {
        const json c = job.delta_chunk(d);
        if (!ok || c.is_null()) continue;
        ok = send(sink, c);
        job.clear_logprobs();
      }
      if (job.n_calls_streamed > 0 && job.finish == "stop") job.finish = "tool_calls";
      last = job.chunk("", job.finish.c_str(), false);
    } else {
      last = job.chunk(job.last_flush, job.finish.c_str(), true);
    }
    last["timings"] = job.timings();  // llama.cpp's place: the choice's last chunk
    return ok && send(sink, last);
  };
  res.set_header("Cache-Control", "no-cache");
  ++open_streams;  // released by the releaser below, which httplib calls for every response
  res.set_chunked_content_provider(
      "text/event-stream",
      [jobs, send, on_event, cancel_all](size_t, httplib::DataSink& sink) -> bool {
        if (!sink.is_writable()) {
          cancel_all(jobs);
          return false;
        }
        bool any = false;
        for (const auto& job : jobs) {
          while (!job->ended) {
            auto e = job->stream->next(0ms);
            if (!e) break;
            any = true;
            if (!on_event(*job, *e, sink)) {
              cancel_all(jobs);
              return false;
            }
          }
        }
        const bool all_ended =
            std::all_of(jobs.begin(), jobs.end(), [](const auto& j) { return j->ended; });
        if (!all_ended) {
          // Nothing ready: wait on the first unfinished choice (httplib calls again and
          // checks the socket meanwhile).
          if (!any)
            for (const auto& job : jobs)
              if (!job->ended) {
                auto e = job->stream->next(100ms);
                if (e && !on_event(*job, *e, sink)) {
                  cancel_all(jobs);
                  return false;
                }
                break;
              }
          return true;
        }
        bool ok = true;
        if (jobs[0]->include_usage) ok = send(sink, jobs[0]->usage_chunk(usage_of(jobs)));
        static constexpr std::string_view kDone = "data: [DONE]\n\n";
        if (ok) ok = sink.write(kDone.data(), kDone.size());
        if (ok) sink.done();
        return ok;
      },
      [this, jobs, cancel_all](bool) {
        cancel_all(jobs);  // no-op after a normal end
        --open_streams;
      });
}

std::string HttpServer::Impl::metrics() const {
  std::string out;
  auto metric = [&](const char* name, const char* type, const char* help, double v) {
    out += fmt::format("# HELP kiln_{} {}\n# TYPE kiln_{} {}\nkiln_{} {}\n", name, help, name, type,
                       name, v);
  };
  metric("http_requests_total", "counter", "HTTP requests received",
         double(n_http_requests.load()));
  metric("http_errors_total", "counter", "HTTP responses with status >= 400",
         double(n_http_errors.load()));
  const ConnectionStats cs = http.stats();
  metric("http_connections_open", "gauge", "connections admitted and not closed", double(cs.open));
  metric("http_connections_waiting", "gauge",
         "open connections waiting for a request header (holding no thread)", double(cs.waiting));
  metric("http_connections_refused_total", "counter",
         "connections refused with 503 (--limits max_connections, max_connections_per_client)",
         double(cs.refused));
  metric("http_header_timeouts_total", "counter",
         "connections answered 408: no whole header within --limits header_timeout",
         double(cs.header_timeouts));
  metric("ready", "gauge", "1 once the model is loaded", ready.load() ? 1 : 0);
  if (!ready.load(std::memory_order_acquire)) return out;
  const SchedulerStats s = scheduler->stats();
  metric("requests_total", "counter", "generation requests accepted", double(s.requests_total));
  metric("requests_rejected_total", "counter", "generation requests refused (queue full)",
         double(s.requests_rejected));
  metric("requests_cancelled_total", "counter",
         "generation requests cancelled (client gone, stop sequence, shutdown)",
         double(s.requests_cancelled));
  metric("prompt_tokens_total", "counter", "prompt tokens of admitted requests",
         double(s.prompt_tokens));
  metric("prompt_tokens_reused_total", "counter",
         "prompt tokens served from a slot's cached KV rows", double(s.prompt_tokens_reused));
  metric("prompt_tokens_shared_total", "counter",
         "of those, n > 1 choices' prompt tokens copied from the first choice's prefill",
         double(s.prompt_tokens_shared));
  metric("generated_tokens_total", "counter", "tokens sampled", double(s.generated_tokens));
  metric("queue_depth", "gauge", "requests waiting for a slot", s.queue_depth);
  metric("slots_busy", "gauge", "slots running a request", s.slots_busy);
  metric("slots_total", "gauge", "slots", s.n_slots);
  const double evaluated = double(s.prompt_tokens - s.prompt_tokens_reused);
  metric("prefill_tokens_per_second", "gauge", "prompt tokens evaluated per second of prefill",
         s.prefill_seconds > 0 ? evaluated / s.prefill_seconds : 0);
  metric("decode_tokens_per_second", "gauge", "tokens decoded per second of decode steps",
         s.decode_seconds > 0 ? double(s.generated_tokens) / s.decode_seconds : 0);
  metric("kv_cache_bytes", "gauge", "bytes held by the slots' KV caches", double(s.kv_bytes));
  metric("kv_cache_positions_used", "gauge", "KV positions in use over all slots",
         double(s.kv_positions_used));
  metric("kv_cache_positions_total", "gauge", "KV positions over all slots",
         double(s.kv_positions_total));
  metric("kv_cache_usage_ratio", "gauge", "used / total KV positions",
         s.kv_positions_total ? double(s.kv_positions_used) / double(s.kv_positions_total) : 0);
  metric("forward_passes_total", "counter", "model forward passes (one per batched step)",
         double(s.forward_passes));
  metric("forward_tokens_total", "counter", "tokens evaluated by those passes",
         double(s.forward_tokens));
  metric("candidate_passes_total", "counter",
         "forward passes that returned each row's top-k candidates (device sampling), not logits",
         double(s.candidate_passes));
  metric("spec_steps_total", "counter", "speculative verify steps (drafted or forced tokens)",
         double(s.spec_steps));
  metric("spec_drafted_tokens_total", "counter", "draft tokens proposed", double(s.spec_drafted));
  metric("spec_accepted_tokens_total", "counter", "draft tokens accepted", double(s.spec_accepted));
  metric("spec_mean_acceptance_length", "gauge", "tokens emitted per verify step (accepted + 1)",
         s.spec_steps ? 1.0 + double(s.spec_accepted) / double(s.spec_steps) : 0);
  metric("spec_draft_seconds_total", "counter", "seconds spent drafting", s.spec_draft_seconds);
  metric("spec_forced_steps_total", "counter",
         "of the verify steps, constrained requests' steps with the tokens the grammar forces",
         double(s.forced_steps));
  metric("spec_forced_accepted_tokens_total", "counter", "forced tokens accepted",
         double(s.forced_accepted));
  // The process registry (core/counters.h): subsystems such as the expert store (moe.*) and
  // the speculative decoder (spec.*) count there without knowing about HTTP. Dots become
  // underscores so every name is a valid Prometheus metric name.
  for (const CounterSample& c : process_counters().snapshot()) {
    std::string name = "registry_";
    for (char ch : c.name) name += std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
    if (c.is_timer) {
      metric((name + "_seconds_total").c_str(), "counter",
             ("time recorded by timer " + c.name).c_str(), double(c.value) * 1e-9);
      metric((name + "_count").c_str(), "counter",
             ("intervals recorded by timer " + c.name).c_str(), double(c.n_events));
    } else {
      metric((name + "_total").c_str(), "counter", ("registry counter " + c.name).c_str(),
             double(c.value));
    }
  }
  return out;
}

void HttpServer::Impl::routes() {
  http.set_logger([this](const httplib::Request&, const httplib::Response& res) {
    n_http_requests.fetch_add(1);
    if (res.status >= 400) n_http_errors.fetch_add(1);
  });
  // Errors httplib produces itself (404, 413, 400 on a malformed request line) get the
  // OpenAI error body too.
  http.set_error_handler([](const httplib::Request&, httplib::Response& res) {
    if (!res.body.empty()) return;
    std::string code = res.status == 404   ? "not_found"
                       : res.status == 413 ? "request_too_large"
                                           : "http_error";
    std::string msg = res.status == 404   ? "no such route"
                      : res.status == 413 ? "the request body exceeds the size limit"
                                          : fmt::format("HTTP error {}", res.status);
    send_error(res, make_error(res.status, msg, "invalid_request_error", code));
  });
  // Opt-in CORS (--cors): a browser page of an allowed origin may call the API. Every response
  // to such an origin names it (or `*`); preflights are answered without the API key (browsers
  // send none), and the actual request still needs it. Off: no CORS header, no OPTIONS route.
  if (!opt.cors_origins.empty()) {
    http.set_post_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      if (const std::string o = cors_origin(req); !o.empty()) {
        res.set_header("Access-Control-Allow-Origin", o);
        if (o != "*") res.set_header("Vary", "Origin");
      }
    });
    http.Options(R"(/.*)", [this](const httplib::Request& req, httplib::Response& res) {
      res.status = 204;
      if (cors_origin(req).empty()) return;
      res.set_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS");
      const std::string asked = req.get_header_value("Access-Control-Request-Headers");
      res.set_header("Access-Control-Allow-Headers",
                     asked.empty() ? "Authorization, Content-Type" : asked);
      res.set_header("Access-Control-Max-Age", "600");
    });
  }
  // The chat page (no key needed: it holds nothing; its requests carry the key the user
  // types). Same-origin files only, under a CSP that allows nothing else.
  for (const StaticFile& f : chat_page_files())
    http.Get(std::string(f.path), [&f](const httplib::Request&, httplib::Response& res) {
      res.set_header("Content-Security-Policy", std::string(chat_page_csp()));
      res.set_header("X-Content-Type-Options", "nosniff");
      res.set_header("Cache-Control", "no-cache");
      res.set_content(f.body.data(), f.body.size(), std::string(f.content_type));
    });
  http.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    if (!check_ready(res)) return;
    res.set_content(R"({"status":"ok"})", "application/json");
  });
  http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics(), "text/plain; version=0.0.4");
  });
  // llama.cpp's /props: what a client (a chat page, a tool) needs to know of the server.
  http.Get("/props", [this](const httplib::Request& req, httplib::Response& res) {
    if (!authorized(req, res) || !check_ready(res)) return;
    const SamplingDefaults& d = opt.sampling;
    json params = {{"temperature", d.temperature},
                   {"top_k", d.top_k},
                   {"top_p", d.top_p},
                   {"min_p", d.min_p},
                   {"repeat_penalty", d.repeat_penalty},
                   {"presence_penalty", d.presence_penalty},
                   {"frequency_penalty", d.frequency_penalty},
                   {"n_predict", -1}};
    auto token = [&](int32_t id) { return id != kTokenNull ? tok->token_text(id) : std::string(); };
    json p = {{"default_generation_settings", {{"n_ctx", scheduler->n_ctx()}, {"params", params}}},
              {"total_slots", opt.n_parallel},
              {"model_alias", model_name},
              {"model_path", opt.model_path},
              {"chat_template", chat_template ? std::string(chat_template->source()) : ""},
              {"chat_template_tool_format", tool_format_name(tool_format)},
              {"bos_token", token(tok->bos())},
              {"eos_token", token(tok->eos())},
              {"modalities", {{"vision", false}, {"audio", false}}}};
    res.set_content(p.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
  });
  http.Get("/v1/models", [this](const httplib::Request& req, httplib::Response& res) {
    if (!authorized(req, res) || !check_ready(res)) return;
    json m = {{"id", model_name},
              {"object", "model"},
              {"created", unix_seconds()},
              {"owned_by", "kiln"},
              {"meta",
               {{"n_ctx", scheduler->n_ctx()},
                {"n_vocab", model->n_vocab()},
                {"arch", model->arch_name()},
                {"chat_template", chat_template != nullptr},
                {"backend", std::string(rt->backend().name())}}}};
    res.set_content(json{{"object", "list"}, {"data", json::array({m})}}.dump(),
                    "application/json");
  });
  // Every body is read here, not by httplib: --max-body-kib holds for chunked bodies too
  // (httplib bounds only Content-Length ones), reading stops at the limit instead of after the
  // whole body, and the body is JSON whatever Content-Type says (httplib would refuse an
  // x-www-form-urlencoded body -- curl -d's default -- over 8 KiB with a misleading 413).
  using BodyHandler =
      std::function<void(const httplib::Request&, httplib::Response&, const std::string&)>;
  auto post = [this](const char* path, BodyHandler handle) {
    http.Post(path, [this, handle](const httplib::Request& req, httplib::Response& res,
                                   const httplib::ContentReader& reader) {
      std::string body;
      bool too_large = false;
      const bool read = reader([&](const char* data, size_t n) {
        if (body.size() + n > opt.limits.max_body_bytes) {
          too_large = true;
          return false;
        }
        body.append(data, n);
        return true;
      });
      if (too_large || res.status == 413) {
        res.set_header("Connection", "close");  // the rest of the body is never read
        return send_error(res, make_error(413,
                                          fmt::format("the request body exceeds the limit "
                                                      "of {} KiB (--max-body-kib)",
                                                      opt.limits.max_body_bytes / 1024),
                                          "invalid_request_error", "request_too_large"));
      }
      if (!read) {
        res.set_header("Connection", "close");
        return send_error(res, make_error(400, "the request body could not be read",
                                          "invalid_request_error", "bad_body"));
      }
      handle(req, res, body);
      // A stream's size is bounded by the connection layer (it cuts the stream); a whole
      // body is replaced here, so the client gets one line naming the cap.
      if (res.body.size() > opt.limits.max_response_bytes) {
        res.set_header("Connection", "close");
        send_error(
            res, make_error(500,
                            fmt::format("the response ({} KiB) exceeds the limit of {} "
                                        "KiB (--limits max_response_kib)",
                                        res.body.size() >> 10, opt.limits.max_response_bytes >> 10),
                            "server_error", "response_too_large"));
      }
    });
  };
  post("/v1/chat/completions",
       [this](const httplib::Request& req, httplib::Response& res, const std::string& body) {
         completion(req, res, body, true);
       });
  post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res,
                                 const std::string& body) { completion(req, res, body, false); });
  post("/tokenize", [this](const httplib::Request& req, httplib::Response& res,
                           const std::string& body) {
    if (!authorized(req, res) || !check_ready(res)) return;
    auto r = parse_tokenize_request(body);
    if (auto* e = std::get_if<ApiError>(&r)) return send_error(res, *e);
    const TokenizeRequest& t = std::get<TokenizeRequest>(r);
    const auto ids = tok->encode(t.content, t.add_special, /*parse_special=*/true);
    json tokens = json::array();
    for (int32_t id : ids) {
      if (t.with_pieces)
        tokens.push_back({{"id", id}, {"piece", tok->token_to_piece(id, true)}});
      else
        tokens.push_back(id);
    }
    res.set_content(json{{"tokens", tokens}}.dump(-1, ' ', false, json::error_handler_t::replace),
                    "application/json");
  });
  post("/detokenize",
       [this](const httplib::Request& req, httplib::Response& res, const std::string& body) {
         if (!authorized(req, res) || !check_ready(res)) return;
         auto r = parse_detokenize_request(body);
         if (auto* e = std::get_if<ApiError>(&r)) return send_error(res, *e);
         const DetokenizeRequest& d = std::get<DetokenizeRequest>(r);
         for (size_t i = 0; i < d.tokens.size(); ++i)
           if (d.tokens[i] >= tok->n_vocab())
             return send_error(
                 res, make_error(400,
                                 fmt::format("'tokens[{}]' = {} is outside the vocabulary [0, {})",
                                             i, d.tokens[i], tok->n_vocab()),
                                 "invalid_request_error", "invalid_value"));
         res.set_content(json{{"content", tok->decode(d.tokens)}}.dump(
                             -1, ' ', false, json::error_handler_t::replace),
                         "application/json");
       });
}

}  // namespace kiln::server
