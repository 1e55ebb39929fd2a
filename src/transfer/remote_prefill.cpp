// transfer/remote_prefill.cpp: the prefill producer, the consumer, and the fail-open policy.
#include "transfer/remote_prefill.h"

#include <xxhash.h>

#include <chrono>
#include <cstring>

#include "core/log.h"
#include "kv/kv_cache.h"
#include "kv/kvpack.h"
#include "kv/wire.h"
#include "transfer/identity.h"
#include "transfer/session_pack.h"

namespace kiln::transfer {
namespace {

constexpr char kReq[4] = {'K', 'V', 'R', 'Q'};
constexpr char kOk[4] = {'K', 'V', 'O', 'K'};
constexpr char kErr[4] = {'K', 'V', 'E', 'R'};
constexpr char kAck[4] = {'K', 'V', 'A', 'K'};
constexpr size_t kReqFixed = 4 + 4 + 32 + 4;  // magic, version, identity, n_tokens
constexpr uint32_t kMaxMessage = 4096;

using wire::get;
using wire::put;

std::vector<uint8_t> encode_request(const kvpack::Identity& id, std::span<const int32_t> tokens) {
  std::vector<uint8_t> out(kReq, kReq + 4);
  put<uint32_t>(out, kProtocolVersion);
  put<uint32_t>(out, id.engine_abi);
  put<uint32_t>(out, id.kv_dtype);
  put<uint64_t>(out, id.model);
  put<uint64_t>(out, id.tokenizer);
  put<uint64_t>(out, id.chat_template);
  put<uint32_t>(out, uint32_t(tokens.size()));
  for (int32_t t : tokens) put<int32_t>(out, t);
  put<uint64_t>(out, XXH3_64bits(out.data(), out.size()));
  return out;
}

struct Request {
  kvpack::Identity id;
  std::vector<int32_t> tokens;
};

Expected<Request> read_request(Link& link, Millis timeout) {
  std::vector<uint8_t> buf(kReqFixed);
  KILN_TRY(recv_exact(link, buf, timeout));
  const uint8_t* b = buf.data();
  if (std::memcmp(b, kReq, 4) != 0) return Status::error("not a prefill request (bad magic)");
  if (get<uint32_t>(b + 4) != kProtocolVersion)
    return Status::errorf("prefill protocol version {}, this node speaks {}", get<uint32_t>(b + 4),
                          kProtocolVersion);
  Request r;
  r.id = {.engine_abi = get<uint32_t>(b + 8),
          .kv_dtype = get<uint32_t>(b + 12),
          .model = get<uint64_t>(b + 16),
          .tokenizer = get<uint64_t>(b + 24),
          .chat_template = get<uint64_t>(b + 32)};
  const uint32_t n = get<uint32_t>(b + 40);
  if (n == 0 || n > uint32_t(kvpack::kMaxPositions))
    return Status::errorf("prefill request of {} tokens outside [1, {}]", n, kvpack::kMaxPositions);
  buf.resize(kReqFixed + size_t(n) * 4 + 8);
  KILN_TRY(recv_exact(link, std::span<uint8_t>(buf).subspan(kReqFixed), timeout));
  const size_t body = buf.size() - 8;
  if (XXH3_64bits(buf.data(), body) != get<uint64_t>(buf.data() + body))
    return Status::error("prefill request checksum mismatch");
  r.tokens.resize(n);
  std::memcpy(r.tokens.data(), buf.data() + kReqFixed, size_t(n) * 4);
  return r;
}

void send_error(Link& link, const Status& s, Millis timeout) {
  std::vector<uint8_t> out(kErr, kErr + 4);
  const std::string& m = s.message();
  const uint32_t len = uint32_t(std::min<size_t>(m.size(), kMaxMessage));
  put<uint32_t>(out, len);
  out.insert(out.end(), m.begin(), m.begin() + len);
  (void)link.send(out, timeout);
}

Status produce(Link& link, const Request& req, const std::shared_ptr<const Model>& model,
               Backend& backend, const ProducerOptions& opt) {
  const auto kinds = layer_kinds(*model);
  kvpack::Header probe;
  probe.id = req.id;
  probe.layers = kinds;
  const int32_t n = int32_t(req.tokens.size());
  if (backend.tp_size() > 1)
    return Status::error(
        "remote prefill: a tensor-parallel backend's KV is split over its "
        "GPUs (kvpack does not carry it)");
  Session s(model, backend, n, opt.max_batch);
  // The session's identity, not the model's: a context of n tokens may choose another
  // LongRoPE factor set than the consumer's context did, and such a pack is refused (the
  // consumer then prefills itself).
  KILN_TRY(kvpack::check_compatible(probe, identity_of(s), kinds));
  const KvCache& kv = s.kv_cache();
  kvpack::Header h;
  h.id = identity_of(s);
  h.layers = kinds;
  h.n_pos = n;
  // The positions the producer's cache keeps at the end: all of a full layer; the newest
  // `capacity` rows of a ring (every chunk ends no later than n, the last one exactly at n).
  for (int l = 0; l < kv.n_layers(); ++l) {
    const KvRowMap& m = kv.row_map(l);
    h.lo.push_back(m.is_ring() ? std::max(0, n - m.capacity()) : 0);
  }
  // Validate everything a local eval would before promising KVOK.
  for (int32_t t : req.tokens)
    if (t < 0 || t >= model->n_vocab())
      return Status::errorf("token id {} outside the vocabulary [0, {})", t, model->n_vocab());
  KILN_TRY(link.send({reinterpret_cast<const uint8_t*>(kOk), 4}, opt.io_timeout));
  kvpack::Writer w([&](std::span<const uint8_t> b) { return link.send(b, opt.io_timeout); });
  KILN_TRY(w.header(h));
  const int32_t chunk = s.max_batch();
  for (int32_t start = 0; start < n; start += chunk) {
    const int32_t end = std::min(n, start + chunk);
    auto r = s.eval(
        std::span<const int32_t>(req.tokens).subspan(size_t(start), size_t(end - start)), false);
    if (!r) return r.status();
    for (int l = 0; l < kv.n_layers(); ++l) {
      const int32_t first = std::max(start, h.lo[size_t(l)]);
      if (first < end) KILN_TRY(w.tile(s.kv_cache(), l, first, end - first));
    }
  }
  KILN_TRY(w.finish());
  uint8_t ack[4];
  KILN_TRY(recv_exact(link, ack, opt.io_timeout));
  if (std::memcmp(ack, kAck, 4) != 0) return Status::error("the decode node did not acknowledge");
  return Status::ok();
}

}  // namespace

Status serve_prefill(Link& link, const std::shared_ptr<const Model>& model, Backend& backend,
                     const ProducerOptions& opt) {
  auto req = read_request(link, opt.io_timeout);
  if (!req) {
    send_error(link, req.status(), opt.io_timeout);
    link.close();
    return req.status();
  }
  Status s = produce(link, *req, model, backend, opt);
  // Refusals before KVOK reach the peer as a message; later failures cut the stream, which
  // the consumer detects as truncation.
  if (!s) send_error(link, s, opt.io_timeout);
  link.close();
  return s;
}

Status remote_prefill(Link& link, Session& session, std::span<const int32_t> tokens, Millis timeout,
                      RemoteStats* stats) {
  if (session.n_pos() != 0)
    return Status::errorf("remote prefill into a session holding {} positions", session.n_pos());
  if (tokens.empty()) return Status::error("remote prefill of no tokens");
  const auto t0 = std::chrono::steady_clock::now();
  KILN_TRY(link.send(encode_request(identity_of(session), tokens), timeout));
  uint8_t tag[4];
  KILN_TRY(recv_exact(link, tag, timeout));
  if (std::memcmp(tag, kErr, 4) == 0) {
    uint8_t lb[4];
    KILN_TRY(recv_exact(link, lb, timeout));
    const uint32_t len = std::min(get<uint32_t>(lb), kMaxMessage);
    std::string msg(len, '\0');
    KILN_TRY(recv_exact(link, {reinterpret_cast<uint8_t*>(msg.data()), len}, timeout));
    return Status::errorf("{} refused: {}", link.describe(), msg);
  }
  if (std::memcmp(tag, kOk, 4) != 0)
    return Status::errorf("{}: not a prefill response (bad magic)", link.describe());
  StreamInstall in(session);
  std::vector<uint8_t> buf(size_t(1) << 20);
  while (!in.done()) {
    auto n = link.recv(buf, timeout);
    if (!n) return n.status();
    if (*n == 0) return in.finish().context(link.describe());
    KILN_TRY(in.push({buf.data(), *n}));
  }
  (void)link.send({reinterpret_cast<const uint8_t*>(kAck), 4}, timeout);
  KILN_TRY(in.publish());
  if (session.n_pos() != int32_t(tokens.size()))
    return Status::errorf("{}: the pack holds {} positions for {} tokens", link.describe(),
                          session.n_pos(), tokens.size());
  if (stats) {
    stats->bytes = in.bytes();
    stats->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  return Status::ok();
}

PrefillPeer tcp_or_ucx_peer(TransportKind kind, const std::string& host, int port, Millis timeout) {
  PrefillPeer p;
  p.name = fmt::format("{} {}:{}", kind == TransportKind::Ucx ? "ucx" : "tcp", host, port);
  p.timeout = timeout;
  p.connect = [=] { return transfer::connect(kind, host, port, timeout); };
  return p;
}

Expected<std::span<const float>> prefill(Session& session, std::span<const int32_t> prompt,
                                         const PrefillPeer* peer, RemoteStats* stats) {
  if (peer && prompt.size() > 1 && session.n_pos() == 0) {
    const auto head = prompt.first(prompt.size() - 1);
    Status s;
    if (auto link = peer->connect(); !link) {
      s = link.status();
    } else {
      s = remote_prefill(**link, session, head, peer->timeout, stats);
    }
    if (s) {
      auto r = session.eval(prompt.last(1), false);
      if (r) return r;
      s = r.status();
      (void)session.rollback(0);
    }
    // Fails open: the session is untouched by a failed install, so a local prefill gives the
    // very output the remote one would have.
    log_notice("remote prefill from {} failed ({}); prefilling locally", peer->name, s.message());
  }
  return session.eval(prompt, false);
}

}  // namespace kiln::transfer
