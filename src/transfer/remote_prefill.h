// transfer/remote_prefill.h: disaggregated prefill. The decode node sends its identity and the
// prompt; the prefill node checks the identity, prefills in chunks on a fresh Session and
// streams kvpack tiles after each chunk (the transfer of chunk i overlaps the compute of chunk
// i+1); the decode node installs them into a fresh cache and publishes it to its session.
//
// Wire format (after connect; little-endian):
//   request  "KVRQ" u32 version, u32 engine_abi, u32 kv_dtype, u64 model, u64 tokenizer,
//            u64 chat_template, u32 n_tokens, i32 tokens[n_tokens], u64 xxh3(all before)
//   response "KVOK" then one kvpack stream (docs/kvpack.md), or
//            "KVER" u32 length, message bytes (a refusal: other model, bad tokens, ...)
//   then     "KVAK" from the decode node once the pack verified, so the producer closes only
//            after every byte arrived (UCX streams have no half-close to wait on).
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/session.h"
#include "transfer/transport.h"

namespace kiln::transfer {

inline constexpr uint32_t kProtocolVersion = 1;

struct ProducerOptions {
  int32_t max_batch = 0;     // prefill chunk (0: the Session default)
  Millis io_timeout{30000};  // on every read and write of the connection
};

// Serves one request on `link`, then closes it. Errors are also sent to the peer as KVER when
// the connection still works; the producer's own state is never affected by a bad request.
Status serve_prefill(Link& link, const std::shared_ptr<const Model>& model, Backend& backend,
                     const ProducerOptions& opt = {});

struct RemoteStats {
  double seconds = 0;  // request sent .. pack published
  uint64_t bytes = 0;  // kvpack bytes received
};

// Asks the peer behind `link` to prefill `tokens` and installs the result into `session`,
// which must hold no positions. On error the session is unchanged.
Status remote_prefill(Link& link, Session& session, std::span<const int32_t> tokens, Millis timeout,
                      RemoteStats* stats = nullptr);

// Where a decode node gets its prefill from. connect() is the seam tests replace.
struct PrefillPeer {
  std::string name;  // for the notice line, e.g. "tcp 10.0.0.2:7070"
  std::function<Expected<std::unique_ptr<Link>>()> connect;
  Millis timeout{30000};
};
PrefillPeer tcp_or_ucx_peer(TransportKind kind, const std::string& host, int port, Millis timeout);

// Evaluates `prompt` into the empty `session` and returns the last token's logits. With a peer:
// positions [0, n-1) come from the peer, the last token runs locally (the decode node needs its
// logits). Any failure of the remote path (connect, refusal, stall, corruption, truncation)
// falls back to a local prefill after one notice line on stderr: the output is the same.
Expected<std::span<const float>> prefill(Session& session, std::span<const int32_t> prompt,
                                         const PrefillPeer* peer, RemoteStats* stats = nullptr);

}  // namespace kiln::transfer
