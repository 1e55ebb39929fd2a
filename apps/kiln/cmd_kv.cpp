// apps/kiln/cmd_kv.cpp: `kiln kv`: kvpack from the command line. save (prefill a prompt and
// write its KV), load (install a saved pack and continue with more text: session
// persistence), info (verify a pack and print its header), and remote (a one-shot decode
// node: prefill on a peer started with `kiln serve --role prefill`, then decode here).
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

#include "apps/kiln/commands.h"
#include "apps/kiln/config_cli.h"
#include "apps/kiln/gen_common.h"
#include "apps/kiln/prefill_node.h"
#include "core/log.h"
#include "kv/kvpack.h"
#include "transfer/remote_prefill.h"
#include "transfer/session_pack.h"

namespace kiln::app {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

struct KvOptions {
  std::string model, prompt, file, peer, transport = "tcp";
  int32_t n_ctx = 0, n_predict = 32;
  int64_t timeout_ms = 30000;
  bool local = false;
  std::shared_ptr<ConfigOverrides> config;
};

struct Prepared {
  Config cfg;
  std::unique_ptr<Runtime> rt;
  int32_t n_ctx = 0;
};

Expected<Prepared> prepare(const KvOptions& o) {
  Prepared p;
  KILN_ASSIGN_OR_RETURN(p.cfg, load_config(*o.config));
  if (auto lvl = parse_log_level(p.cfg.log_level)) set_log_level(*lvl);
  if (o.n_ctx < 0) return Status::errorf("-c {} must be >= 0", o.n_ctx);
  if (o.n_predict < 0) return Status::errorf("-n {} must be >= 0", o.n_predict);
  KILN_ASSIGN_OR_RETURN(std::string path, resolve_model_path(o.model, p.cfg));
  KILN_ASSIGN_OR_RETURN(const EngineOptions eo, engine_options(p.cfg));
  KILN_ASSIGN_OR_RETURN(Runtime rt, Runtime::open(path, eo));
  p.rt = std::make_unique<Runtime>(std::move(rt));
  p.n_ctx = o.n_ctx > 0 ? o.n_ctx : std::min(p.rt->model()->n_ctx_train(), 4096);
  return p;
}

int32_t argmax(std::span<const float> v) {
  return static_cast<int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

// Greedy decoding from `logits` for up to n tokens, text to stdout; returns the ids.
Expected<std::vector<int32_t>> generate(Session& s, const Tokenizer& tok,
                                        std::span<const float> logits, int32_t n) {
  std::vector<int32_t> ids;
  Utf8Stream stream;
  for (int32_t i = 0; i < n && s.n_pos() < s.n_ctx(); ++i) {
    const int32_t id = argmax(logits);
    ids.push_back(id);
    if (tok.is_eog(id)) break;
    const std::string text = stream.push(tok.token_to_piece(id, false));
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);
    if (i + 1 == n) break;
    KILN_ASSIGN_OR_RETURN(logits, s.eval(std::span<const int32_t>(&id, 1), false));
  }
  const std::string rest = stream.flush();
  std::fwrite(rest.data(), 1, rest.size(), stdout);
  std::fflush(stdout);
  return ids;
}

Status kv_save(const KvOptions& o) {
  if (o.prompt.empty()) return Status::error("empty prompt (give -p PROMPT)");
  if (o.file.empty()) return Status::error("no output file (give -o FILE)");
  KILN_ASSIGN_OR_RETURN(Prepared p, prepare(o));
  const auto prompt = p.rt->tokenizer().encode(o.prompt, /*add_special=*/true, false);
  if (prompt.empty()) return Status::error("the prompt tokenized to nothing");
  if (int64_t(prompt.size()) > p.n_ctx)
    return Status::errorf("prompt of {} tokens does not fit the context of {} (-c)", prompt.size(),
                          p.n_ctx);
  Session s(p.rt->model(), p.rt->backend(), p.n_ctx);
  KILN_TRY(s.eval(prompt, false));
  KILN_TRY(transfer::save_session_file(s, o.file));
  fmt::print(stderr, "kiln kv save: {} positions -> {}\n", s.n_pos(), o.file);
  return Status::ok();
}

Status kv_load(const KvOptions& o) {
  if (o.file.empty()) return Status::error("no pack (give -i FILE)");
  if (o.prompt.empty()) return Status::error("give -p TEXT to continue the saved sequence with");
  KILN_ASSIGN_OR_RETURN(Prepared p, prepare(o));
  Session s(p.rt->model(), p.rt->backend(), p.n_ctx);
  KILN_TRY(transfer::load_session_file(s, o.file));
  const int32_t restored = s.n_pos();
  const auto more = p.rt->tokenizer().encode(o.prompt, /*add_special=*/false, false);
  if (more.empty()) return Status::error("the continuation tokenized to nothing");
  if (int64_t(restored) + int64_t(more.size()) > p.n_ctx)
    return Status::errorf("{} restored + {} new tokens exceed the context of {} (-c)", restored,
                          more.size(), p.n_ctx);
  KILN_ASSIGN_OR_RETURN(std::span<const float> logits, s.eval(more, false));
  KILN_ASSIGN_OR_RETURN(std::vector<int32_t> ids,
                        generate(s, p.rt->tokenizer(), logits, o.n_predict));
  fmt::print(stderr, "kiln kv load: {} positions restored, {} new, {} generated\n", restored,
             more.size(), ids.size());
  fmt::print(stderr, "kiln kv load: ids xxh64 {}\n", hash_ids(ids));
  return Status::ok();
}

Status kv_info(const KvOptions& o) {
  if (o.file.empty()) return Status::error("no pack (give -i FILE)");
  std::FILE* f = std::fopen(o.file.c_str(), "rb");
  if (!f) return Status::errorf("cannot open '{}'", o.file);
  uint32_t n_tiles = 0;
  kvpack::Parser parser(nullptr, [&](const kvpack::Tile&) {
    ++n_tiles;
    return Status::ok();
  });
  std::vector<uint8_t> buf(1 << 20);
  Status st;
  for (size_t n; st && (n = std::fread(buf.data(), 1, buf.size(), f)) > 0;)
    st = parser.push({buf.data(), n});
  std::fclose(f);
  if (st) st = parser.finish();
  if (!st) return st.context(fmt::format("'{}'", o.file));
  const kvpack::Header& h = parser.header();
  fmt::print("kvpack {}: verified, {} bytes, {} tiles\n", o.file, parser.bytes_consumed(), n_tiles);
  fmt::print("positions {}  engine ABI {}  kv dtype {}\n", h.n_pos, h.id.engine_abi, h.id.kv_dtype);
  fmt::print("model {:016x}  tokenizer {:016x}  chat template {:016x}\n", h.id.model,
             h.id.tokenizer, h.id.chat_template);
  for (size_t l = 0; l < h.layers.size(); ++l)
    fmt::print("layer {:3}: width {} {} {} rows [{}, {})\n", l, h.layers[l].width,
               h.layers[l].window ? fmt::format("window {}", h.layers[l].window) : "full",
               h.layers[l].rope ? "RoPE" : "NoPE", h.lo[l], h.n_pos);
  return Status::ok();
}

Status kv_remote(const KvOptions& o) {
  if (o.prompt.empty()) return Status::error("empty prompt (give -p PROMPT)");
  if (o.peer.empty() && !o.local) return Status::error("give --prefill-peer HOST:PORT or --local");
  KILN_ASSIGN_OR_RETURN(transfer::TransportKind kind, transfer::transport_from_name(o.transport));
  if (o.timeout_ms <= 0) return Status::errorf("--timeout-ms {} must be > 0", o.timeout_ms);
  KILN_ASSIGN_OR_RETURN(Prepared p, prepare(o));
  const auto prompt = p.rt->tokenizer().encode(o.prompt, /*add_special=*/true, false);
  if (prompt.empty()) return Status::error("the prompt tokenized to nothing");
  if (int64_t(prompt.size()) >= p.n_ctx)
    return Status::errorf("prompt of {} tokens leaves no room in the context of {} (-c)",
                          prompt.size(), p.n_ctx);
  std::optional<transfer::PrefillPeer> peer;
  if (!o.local) {
    KILN_ASSIGN_OR_RETURN(auto hp, transfer::parse_host_port(o.peer));
    peer = transfer::tcp_or_ucx_peer(kind, hp.first, hp.second, transfer::Millis(o.timeout_ms));
  }
  Session s(p.rt->model(), p.rt->backend(), p.n_ctx);
  transfer::RemoteStats rs;
  const auto t0 = Clock::now();
  KILN_ASSIGN_OR_RETURN(std::span<const float> logits,
                        transfer::prefill(s, prompt, peer ? &*peer : nullptr, &rs));
  const double ttft = seconds_since(t0);
  KILN_ASSIGN_OR_RETURN(std::vector<int32_t> ids,
                        generate(s, p.rt->tokenizer(), logits, o.n_predict));
  if (rs.bytes)
    fmt::print(stderr,
               "kiln kv remote: prompt {} tokens, remote prefill + transfer {:.3f} s, {} bytes "
               "({:.1f} MB/s), TTFT {:.3f} s\n",
               prompt.size(), rs.seconds, rs.bytes, double(rs.bytes) / rs.seconds / 1e6, ttft);
  else
    fmt::print(stderr, "kiln kv remote: prompt {} tokens, local prefill, TTFT {:.3f} s\n",
               prompt.size(), ttft);
  fmt::print(stderr, "kiln kv remote: ids xxh64 {}\n", hash_ids(ids));
  return Status::ok();
}

void add(CLI::App* kv, const char* name, const char* help, Status (*fn)(const KvOptions&),
         int& exit_code, bool with_model, bool with_peer) {
  auto* cmd = kv->add_subcommand(name, help);
  auto o = std::make_shared<KvOptions>();
  if (with_model) {
    cmd->add_option("-m,--model", o->model, "GGUF model (default: the demo model stories260K)");
    cmd->add_option("-p,--prompt", o->prompt, "prompt text");
    cmd->add_option("-c,--ctx-size", o->n_ctx, "context size (default min(training, 4096))");
    cmd->add_option("-n,--n-predict", o->n_predict, "greedy tokens to generate (default 32)");
  }
  if (std::string(name) == "save") cmd->add_option("-o,--output", o->file, "kvpack file to write");
  if (std::string(name) != "save" && !with_peer)
    cmd->add_option("-i,--input", o->file, "kvpack file to read");
  if (with_peer) {
    cmd->add_option("--prefill-peer", o->peer, "HOST:PORT of a prefill node (kiln kv serve)");
    cmd->add_option("--transport", o->transport, "tcp or ucx (default tcp)");
    cmd->add_option("--timeout-ms", o->timeout_ms, "stall timeout before local prefill (30000)");
    cmd->add_flag("--local", o->local, "prefill locally (the baseline)");
  }
  o->config = add_config_options(cmd);
  cmd->callback([o, fn, name, &exit_code] {
    if (Status s = fn(*o); !s) {
      std::fflush(stdout);
      fmt::print(stderr, "kiln kv {}: {}\n", name, s.message());
      exit_code = 1;
    }
  });
}

// `kiln kv serve`: the prefill node (apps/kiln/prefill_node.h) in any build, the HTTP server
// not needed.
void add_serve(CLI::App* kv, int& exit_code) {
  auto* cmd = kv->add_subcommand(
      "serve", "prefill node: prefill decode nodes' prompts and stream their KV (no HTTP)");
  struct Options {
    std::string model;
    PrefillNodeOptions node;
    std::shared_ptr<ConfigOverrides> config;
  };
  auto o = std::make_shared<Options>();
  cmd->add_option("-m,--model", o->model, "GGUF model (default: the demo model stories260K)");
  cmd->add_option("--host", o->node.host, "address to listen on (default 127.0.0.1)");
  cmd->add_option("--kv-port", o->node.port, "port for decode nodes (default 7070; 0: any)");
  cmd->add_option("--transport", o->node.transport, "tcp or ucx (default tcp)");
  cmd->add_option("--prefill-chunk", o->node.chunk, "prompt tokens per step (default 256)");
  cmd->add_option("--timeout-ms", o->node.timeout_ms, "drop a stalled decode node after (30000)");
  o->config = add_config_options(cmd);
  cmd->callback([o, &exit_code] {
    Status s = [&]() -> Status {
      KILN_ASSIGN_OR_RETURN(Config cfg, load_config(*o->config));
      if (auto lvl = parse_log_level(cfg.log_level)) set_log_level(*lvl);
      KILN_ASSIGN_OR_RETURN(o->node.model_path, resolve_model_path(o->model, cfg));
      sigset_t sigs;  // to sigwait in run_prefill_node, not to a worker thread
      sigemptyset(&sigs);
      sigaddset(&sigs, SIGTERM);
      sigaddset(&sigs, SIGINT);
      pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
      return run_prefill_node(o->node, cfg, sigs);
    }();
    if (!s) {
      std::fflush(stdout);
      fmt::print(stderr, "kiln kv serve: {}\n", s.message());
      exit_code = 1;
    }
  });
}

}  // namespace

void add_kv_command(CLI::App& app, int& exit_code) {
  auto* kv = app.add_subcommand("kv", "KV cache packs (kvpack): save, load, info, remote prefill");
  kv->require_subcommand(1);
  add(kv, "save", "prefill a prompt and save its KV cache", kv_save, exit_code, true, false);
  add(kv, "load", "load a saved KV cache and continue with more text", kv_load, exit_code, true,
      false);
  add(kv, "info", "verify a kvpack file and print its header", kv_info, exit_code, false, false);
  add(kv, "remote", "prefill on a peer (kiln kv serve / serve --role prefill), decode here",
      kv_remote, exit_code, true, true);
  add_serve(kv, exit_code);
}

}  // namespace kiln::app
