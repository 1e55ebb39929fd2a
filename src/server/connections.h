// server/connections.h: the connection layer under cpp-httplib's request handling. httplib
// 0.11 gives every accepted connection a pool thread that blocks reading its headers, so 80
// clients that never finish a header stall the server (issue 37). Here a connection is
// admitted (total and per-client caps), then waits in one epoll thread until its whole header
// has arrived (or the header timeout answers 408); only then does a pool thread run httplib's
// request parsing and routing on it, over a stream that enforces the body and write timeouts
// and the response size cap. A kept-alive connection goes back to that waiting room between
// requests, so idle clients hold no thread either.
#pragma once

#include <httplib.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "server/limits.h"

namespace kiln::server {

struct ConnectionStats {
  int64_t open = 0;                // connections admitted and not yet closed
  int64_t waiting = 0;             // of those, waiting for a request's header (no thread held)
  uint64_t refused = 0;            // answered 503 for a connection cap
  uint64_t header_timeouts = 0;    // answered 408: the header did not arrive in time
  uint64_t oversized_headers = 0;  // answered 431
};

class GuardedServer : public httplib::Server {
 public:
  // `threads`: the pool that runs requests whose header is complete.
  GuardedServer(const ServerLimits& limits, size_t threads);
  ~GuardedServer() override;
  GuardedServer(const GuardedServer&) = delete;
  GuardedServer& operator=(const GuardedServer&) = delete;

  ConnectionStats stats() const;

  // httplib listens with a backlog of 5: a burst of connections while the listen thread waits
  // for a core loses SYNs and those clients retry a second later. Call after binding.
  void widen_backlog();

  struct Conn;

 private:
  // httplib's listen loop calls this for every accepted socket (through the inline task
  // queue, on the listen thread): admission only, it never blocks.
  bool process_and_close_socket(socket_t sock) override;

  void start_serving();     // the pool and the waiting room; from new_task_queue
  void shutdown_serving();  // from the task queue's shutdown, once the listen loop ended
  void wait_for_header(std::shared_ptr<Conn> c);  // hand a connection to the waiting room
  void waiting_room();                            // the epoll thread
  void serve(const std::shared_ptr<Conn>& c);     // one request, on a pool thread
  void close_conn(Conn& c);

  class InlineQueue;

  const ServerLimits limits_;
  const size_t n_threads_;
  std::unique_ptr<httplib::ThreadPool> pool_;
  std::thread room_thread_;
  int epoll_fd_ = -1, wake_fd_ = -1;
  std::atomic<bool> stopping_{false};

  mutable std::mutex mu_;                     // guards everything below
  std::vector<std::shared_ptr<Conn>> inbox_;  // to the waiting room
  bool room_closed_ = false;
  std::map<std::string, int32_t> per_client_;
  ConnectionStats stats_;
};

}  // namespace kiln::server
