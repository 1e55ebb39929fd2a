// transfer/transport.h: the byte-stream seam between a prefill node and a decode node. A Link
// is one connection: ordered, reliable bytes with a timeout on every receive (a stalled peer
// must not hang the decode node). Implementations: an in-memory pair with fault injection
// (tests), TCP sockets, and UCX streams (transport_ucx.cpp, when built with libucx).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>

#include "core/status.h"

namespace kiln::transfer {

using Millis = std::chrono::milliseconds;

class Link {
 public:
  virtual ~Link() = default;
  // Sends every byte (blocks while the peer's buffers are full, at most `timeout`).
  virtual Status send(std::span<const uint8_t> bytes, Millis timeout) = 0;
  // Receives 1..buf.size() bytes; 0 when the peer closed the stream. An error after `timeout`
  // without a byte (the message says "timed out") or when the connection broke.
  virtual Expected<size_t> recv(std::span<uint8_t> buf, Millis timeout) = 0;
  // Ends this side's stream: the peer's recv returns 0 once it has read everything.
  virtual void close() = 0;
  virtual std::string describe() const = 0;  // "tcp 127.0.0.1:4000", for messages
};

class Listener {
 public:
  virtual ~Listener() = default;
  virtual Expected<std::unique_ptr<Link>> accept(Millis timeout) = 0;
  virtual int port() const = 0;  // the bound port (useful after binding port 0)
};

enum class TransportKind { Tcp, Ucx };
// "tcp" / "ucx"; an error for anything else or for ucx in a build without it.
Expected<TransportKind> transport_from_name(std::string_view name);
bool ucx_built();

Expected<std::unique_ptr<Listener>> listen(TransportKind kind, const std::string& host, int port);
Expected<std::unique_ptr<Link>> connect(TransportKind kind, const std::string& host, int port,
                                        Millis timeout);
// "HOST:PORT" -> (host, port), with a one-line error naming the text.
Expected<std::pair<std::string, int>> parse_host_port(std::string_view text);

// Receives exactly buf.size() bytes; a peer that closes early is an error ("closed after N").
Status recv_exact(Link& link, std::span<uint8_t> buf, Millis timeout);

// In-memory pair for tests. Faults apply to bytes travelling from .first to .second:
// after `stall_after` bytes nothing more arrives (a stalled producer), after `cut_after`
// bytes the stream ends, and the byte at `flip_at` has its low bit flipped.
struct MemoryFaults {
  uint64_t stall_after = UINT64_MAX;
  uint64_t cut_after = UINT64_MAX;
  uint64_t flip_at = UINT64_MAX;
};
std::pair<std::unique_ptr<Link>, std::unique_ptr<Link>> memory_pair(MemoryFaults faults = {});

// TCP and UCX implementations (transport.cpp, transport_ucx.cpp).
Expected<std::unique_ptr<Listener>> tcp_listen(const std::string& host, int port);
Expected<std::unique_ptr<Link>> tcp_connect(const std::string& host, int port, Millis timeout);
#if KILN_HAVE_UCX
Expected<std::unique_ptr<Listener>> ucx_listen(const std::string& host, int port);
Expected<std::unique_ptr<Link>> ucx_connect(const std::string& host, int port, Millis timeout);
#endif

}  // namespace kiln::transfer
