// server/limits.h: every bound the HTTP server puts on what a client may hold or send
// (connections, timeouts, sizes), in one struct: `kiln serve` maps one option onto each field
// (docs/server.md lists them) and the connection layer (server/connections.h) enforces them.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kiln::server {

struct ServerLimits {
  // Open connections over all clients; one more is answered 503 and closed at once.
  int32_t max_connections = 1024;
  // Open connections from one peer address (IPv4 or IPv6 text); more get 503.
  int32_t max_connections_per_client = 128;
  // From accept (or from the first byte of a kept-alive connection's next request) to the
  // blank line that ends the headers. A connection still short of it is answered 408 and
  // closed. Until then it holds no HTTP thread: the connection layer waits on it alone.
  int32_t header_timeout_ms = 10'000;
  // From the end of the headers to the last byte of the body; a slower body ends the
  // connection.
  int32_t body_timeout_ms = 60'000;
  // How long a kept-alive connection may sit idle between requests before it is closed.
  int32_t idle_timeout_ms = 5'000;
  // Requests served on one connection before the server closes it.
  int32_t keep_alive_max_requests = 100;
  // One send stalled this long (a client that stops reading) ends the connection.
  int32_t write_timeout_ms = 30'000;
  // The request line plus headers; more is a 431.
  size_t max_header_bytes = 64 << 10;
  // A request body, Content-Length or chunked; more is a 413 (the rest is not read).
  size_t max_body_bytes = 1 << 20;
  // A response: a larger non-streamed body is replaced by a 500 naming the limit; a stream
  // that reaches it is cut there (the connection closes without [DONE]).
  size_t max_response_bytes = 64 << 20;
};

}  // namespace kiln::server
