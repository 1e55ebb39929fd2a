// server/connections.cpp: admission, the waiting room (one epoll thread holding connections
// until their header is whole) and the stream httplib parses requests from (see
// connections.h).
#include "server/connections.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <string_view>

#include "core/log.h"
#include "server/api.h"

namespace kiln::server {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

struct GuardedServer::Conn {
  int fd = -1;
  std::string peer_ip;
  int peer_port = 0;
  std::string in;      // bytes received and not yet consumed by httplib
  size_t in_pos = 0;   // consumed prefix of `in`
  size_t scanned = 0;  // `in` holds no "\r\n\r\n" that ends before this + 3
  Clock::time_point deadline;
  bool idle = false;  // kept alive, no byte of its next request yet
  int32_t n_served = 0;

  bool header_complete() {
    const size_t from = std::max(in_pos, scanned);
    const bool found = in.find("\r\n\r\n", from) != std::string::npos;
    if (!found) scanned = in.size() >= 3 ? in.size() - 3 : 0;
    return found;
  }
  size_t pending() const { return in.size() - in_pos; }
  void compact() {
    in.erase(0, in_pos);
    in_pos = 0;
    scanned = 0;
  }
};

namespace {

// Waits until `fd` has `events` or `deadline` passes; false on timeout, error or hang-up.
bool wait_for(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd p{fd, events, 0};
    const int r = ::poll(&p, 1, int(std::min<int64_t>(left, 1 << 30)));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    if (p.revents & events) return true;
    if (p.revents & (POLLERR | POLLHUP | POLLNVAL)) return false;
  }
}

// A short answer to a connection the server gives up on before httplib sees it: best
// effort, never blocking (the socket is non-blocking; a client that reads nothing loses it).
void answer_and_forget(int fd, int status, const char* reason, const ApiError& e) {
  const std::string body = error_body(e);
  std::string msg =
      "HTTP/1.1 " + std::to_string(status) + " " + reason +
      "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
      "\r\nConnection: close\r\n";
  if (status == 503) msg += "Retry-After: 1\r\n";
  msg += "\r\n" + body;
  [[maybe_unused]] const ssize_t n =
      ::send(fd, msg.data(), msg.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
}

ApiError limit_error(int status, std::string message, std::string code) {
  ApiError e;
  e.status = status;
  e.message = std::move(message);
  e.type = status >= 500 ? "server_error" : "invalid_request_error";
  e.code = std::move(code);
  return e;
}

// The status of a response's first line ("HTTP/1.1 200 OK\r\n..."), or 0.
int status_of(std::string_view head) {
  if (head.size() < 12 || head.substr(0, 5) != "HTTP/") return 0;
  const size_t sp = head.find(' ');
  if (sp == std::string_view::npos || sp + 4 > head.size()) return 0;
  int s = 0;
  for (size_t i = sp + 1; i < sp + 4; ++i) {
    if (head[i] < '0' || head[i] > '9') return 0;
    s = s * 10 + (head[i] - '0');
  }
  return s;
}

// The stream httplib reads one request from and writes its response to. Reads come first
// from the bytes the waiting room already received (the whole header, perhaps more), then
// from the socket until the body deadline; bytes read past this request stay with the
// connection for the next one (pipelining). Writes wait at most the write timeout per stall,
// and the response is cut at the size cap.
class ConnStream final : public httplib::Stream {
 public:
  ConnStream(GuardedServer::Conn& c, const ServerLimits& limits)
      : c_(c),
        limits_(limits),
        body_deadline_(Clock::now() + milliseconds(limits.body_timeout_ms)) {}

  bool is_readable() const override {
    return c_.pending() > 0 || wait_for(c_.fd, POLLIN, body_deadline_);
  }
  bool is_writable() const override {
    return wait_for(c_.fd, POLLOUT, Clock::now() + milliseconds(limits_.write_timeout_ms));
  }

  ssize_t read(char* ptr, size_t size) override {
    if (size == 0) return 0;
    if (c_.pending() > 0) {
      const size_t n = std::min(size, c_.pending());
      std::memcpy(ptr, c_.in.data() + c_.in_pos, n);
      c_.in_pos += n;
      if (c_.in_pos == c_.in.size()) {
        c_.in.clear();
        c_.in_pos = c_.scanned = 0;
      }
      return ssize_t(n);
    }
    char buf[4096];  // as httplib's own stream: a worker's stack stays small
    for (;;) {
      if (!wait_for(c_.fd, POLLIN, body_deadline_)) {
        failed_ = true;  // the body did not come in time: the connection is not reused
        return -1;
      }
      const ssize_t n = ::recv(c_.fd, buf, sizeof buf, MSG_DONTWAIT);
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
      if (n <= 0) {
        failed_ = true;
        return n;
      }
      const size_t give = std::min(size, size_t(n));
      std::memcpy(ptr, buf, give);
      if (give < size_t(n)) c_.in.append(buf + give, size_t(n) - give);
      return ssize_t(give);
    }
  }

  ssize_t write(const char* ptr, size_t size) override {
    if (failed_) return -1;
    if (status_ == 0 || (status_ >= 100 && status_ < 200)) {
      // httplib writes the status line and headers in one call.
      const std::string_view head(ptr, size);
      status_ = status_of(head);
      if (status_ == 400 || status_ == 408 || status_ == 413 || status_ == 414 || status_ == 431 ||
          head.find("\r\nConnection: close\r\n") != std::string_view::npos)
        close_after_ = true;
    } else {
      body_bytes_ += size;
      if (body_bytes_ > limits_.max_response_bytes) {
        if (!cut_logged_)
          log_warn("a response from {}:{} reached --limits max_response_kib ({} KiB) and was cut",
                   c_.peer_ip, c_.peer_port, limits_.max_response_bytes >> 10);
        cut_logged_ = true;
        failed_ = true;
        return -1;
      }
    }
    size_t sent = 0;
    while (sent < size) {
      const ssize_t n = ::send(c_.fd, ptr + sent, size - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        sent += size_t(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) &&
          wait_for(c_.fd, POLLOUT, Clock::now() + milliseconds(limits_.write_timeout_ms)))
        continue;
      failed_ = true;
      return -1;
    }
    return ssize_t(size);
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    ip = c_.peer_ip;
    port = c_.peer_port;
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    sockaddr_storage a{};
    socklen_t len = sizeof a;
    ip.clear();
    port = 0;
    if (::getsockname(c_.fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) return;
    char text[INET6_ADDRSTRLEN] = {};
    if (a.ss_family == AF_INET) {
      const auto& v4 = reinterpret_cast<const sockaddr_in&>(a);
      ::inet_ntop(AF_INET, &v4.sin_addr, text, sizeof text);
      port = ntohs(v4.sin_port);
    } else if (a.ss_family == AF_INET6) {
      const auto& v6 = reinterpret_cast<const sockaddr_in6&>(a);
      ::inet_ntop(AF_INET6, &v6.sin6_addr, text, sizeof text);
      port = ntohs(v6.sin6_port);
    }
    ip = text;
  }
  socket_t socket() const override { return c_.fd; }

  // Whether the connection may carry another request.
  bool reusable() const { return !failed_ && !close_after_; }

 private:
  GuardedServer::Conn& c_;
  const ServerLimits& limits_;
  const Clock::time_point body_deadline_;
  int status_ = 0;
  size_t body_bytes_ = 0;
  bool failed_ = false, close_after_ = false, cut_logged_ = false;
};

}  // namespace

// httplib's listen loop hands every accepted socket to its task queue; this one runs the
// admission inline on the listen thread (it never blocks) and, when the loop ends, stops the
// waiting room and the request pool.
class GuardedServer::InlineQueue final : public httplib::TaskQueue {
 public:
  explicit InlineQueue(GuardedServer& s) : s_(s) {}
  void enqueue(std::function<void()> fn) override { fn(); }
  void shutdown() override { s_.shutdown_serving(); }

 private:
  GuardedServer& s_;
};

GuardedServer::GuardedServer(const ServerLimits& limits, size_t threads)
    : limits_(limits), n_threads_(std::max<size_t>(threads, 1)) {
  new_task_queue = [this] {
    start_serving();
    return new InlineQueue(*this);
  };
  // What httplib writes in the Keep-Alive header; the limits themselves are enforced here.
  set_keep_alive_max_count(size_t(std::max(limits_.keep_alive_max_requests, 1)));
  set_keep_alive_timeout(std::max<time_t>(1, (limits_.idle_timeout_ms + 999) / 1000));
  set_payload_max_length(limits_.max_body_bytes);
}

GuardedServer::~GuardedServer() {
  if (room_thread_.joinable()) shutdown_serving();
}

ConnectionStats GuardedServer::stats() const {
  std::lock_guard lk(mu_);
  return stats_;
}

void GuardedServer::widen_backlog() {
  // listen() again on a listening socket only changes its backlog (the kernel caps it at
  // net.core.somaxconn).
  if (svr_sock_ != INVALID_SOCKET) ::listen(svr_sock_, std::max(limits_.max_connections, 128));
}

void GuardedServer::start_serving() {
  stopping_.store(false);
  {
    std::lock_guard lk(mu_);
    room_closed_ = false;
  }
  pool_ = std::make_unique<httplib::ThreadPool>(n_threads_);
  epoll_fd_ = ::epoll_create1(EPOLL_CLOEXEC);
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = wake_fd_;
  ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, wake_fd_, &ev);
  room_thread_ = std::thread([this] { waiting_room(); });
}

void GuardedServer::shutdown_serving() {
  stopping_.store(true);
  {
    std::lock_guard lk(mu_);
    room_closed_ = true;
  }
  const uint64_t one = 1;
  [[maybe_unused]] const ssize_t w = ::write(wake_fd_, &one, sizeof one);
  if (room_thread_.joinable()) room_thread_.join();
  // Requests already running finish (the scheduler cancels generations at stop); their
  // connections then close, as the room no longer takes them.
  if (pool_) pool_->shutdown();
  pool_.reset();
  ::close(epoll_fd_);
  ::close(wake_fd_);
  epoll_fd_ = wake_fd_ = -1;
}

bool GuardedServer::process_and_close_socket(socket_t sock) {
  auto c = std::make_shared<Conn>();
  c->fd = sock;
  sockaddr_storage a{};
  socklen_t len = sizeof a;
  char text[INET6_ADDRSTRLEN] = {};
  if (::getpeername(sock, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    if (a.ss_family == AF_INET) {
      const auto& v4 = reinterpret_cast<const sockaddr_in&>(a);
      ::inet_ntop(AF_INET, &v4.sin_addr, text, sizeof text);
      c->peer_port = ntohs(v4.sin_port);
    } else if (a.ss_family == AF_INET6) {
      const auto& v6 = reinterpret_cast<const sockaddr_in6&>(a);
      ::inet_ntop(AF_INET6, &v6.sin6_addr, text, sizeof text);
      c->peer_port = ntohs(v6.sin6_port);
    }
  }
  c->peer_ip = text;
  ::fcntl(sock, F_SETFL, ::fcntl(sock, F_GETFL) | O_NONBLOCK);
  std::string refusal;
  {
    std::lock_guard lk(mu_);
    if (room_closed_) {
      refusal = "the server is shutting down";
    } else if (stats_.open >= limits_.max_connections) {
      refusal =
          fmt::format("the server holds its limit of {} connections (--limits max_connections)",
                      limits_.max_connections);
    } else if (per_client_[c->peer_ip] >= limits_.max_connections_per_client) {
      refusal = fmt::format(
          "this client holds its limit of {} connections (--limits max_connections_per_client)",
          limits_.max_connections_per_client);
    }
    if (refusal.empty()) {
      ++stats_.open;
      ++per_client_[c->peer_ip];
    } else {
      ++stats_.refused;
      if (per_client_[c->peer_ip] == 0) per_client_.erase(c->peer_ip);
    }
  }
  if (!refusal.empty()) {
    answer_and_forget(sock, 503, "Service Unavailable",
                      limit_error(503, refusal, "too_many_connections"));
    ::shutdown(sock, SHUT_RDWR);
    ::close(sock);
    return false;
  }
  c->deadline = Clock::now() + milliseconds(limits_.header_timeout_ms);
  wait_for_header(std::move(c));
  return true;
}

void GuardedServer::wait_for_header(std::shared_ptr<Conn> c) {
  {
    std::lock_guard lk(mu_);
    if (!room_closed_) {
      inbox_.push_back(std::move(c));
      c = nullptr;
    }
  }
  if (c) return close_conn(*c);
  const uint64_t one = 1;
  [[maybe_unused]] const ssize_t w = ::write(wake_fd_, &one, sizeof one);
}

void GuardedServer::close_conn(Conn& c) {
  if (c.fd < 0) return;
  ::shutdown(c.fd, SHUT_RDWR);
  ::close(c.fd);
  c.fd = -1;
  std::lock_guard lk(mu_);
  --stats_.open;
  if (auto it = per_client_.find(c.peer_ip); it != per_client_.end() && --it->second <= 0)
    per_client_.erase(it);
}

void GuardedServer::waiting_room() {
  std::map<int, std::shared_ptr<Conn>> waiting;  // by fd
  std::vector<epoll_event> events(256);
  auto forget = [&](std::map<int, std::shared_ptr<Conn>>::iterator it) {
    ::epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, it->first, nullptr);
    std::shared_ptr<Conn> c = std::move(it->second);
    waiting.erase(it);
    return c;
  };
  auto dispatch = [&](std::shared_ptr<Conn> c) { pool_->enqueue([this, c] { serve(c); }); };
  // Reads what has arrived; false when the peer closed or failed before its header was whole.
  auto receive = [&](Conn& c) {
    char buf[16 << 10];
    for (;;) {
      if (c.pending() > limits_.max_header_bytes) return true;
      const ssize_t n = ::recv(c.fd, buf, sizeof buf, MSG_DONTWAIT);
      if (n > 0) {
        if (c.idle) {  // the next request began: its header has the full timeout
          c.idle = false;
          c.deadline = Clock::now() + milliseconds(limits_.header_timeout_ms);
        }
        c.in.append(buf, size_t(n));
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
      return c.header_complete();  // EOF or error: only a whole request is still served
    }
  };
  auto next_scan = Clock::now();
  for (;;) {
    const int n = ::epoll_wait(epoll_fd_, events.data(), int(events.size()), 50);
    std::vector<std::shared_ptr<Conn>> arrived;
    bool closing = false;
    {
      // Once room_closed_ is set nothing enters the inbox: this swap takes the last of it.
      std::lock_guard lk(mu_);
      closing = room_closed_;
      arrived.swap(inbox_);
    }
    if (closing) {
      for (auto& c : arrived) close_conn(*c);
      for (auto& [fd, c] : waiting) close_conn(*c);
      std::lock_guard lk(mu_);
      stats_.waiting = 0;
      return;
    }
    for (auto& c : arrived) {
      if (c->header_complete()) {
        dispatch(std::move(c));
        continue;
      }
      epoll_event ev{};
      ev.events = EPOLLIN | EPOLLRDHUP;
      ev.data.fd = c->fd;
      ::epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, c->fd, &ev);
      waiting.emplace(c->fd, std::move(c));
    }
    for (int i = 0; i < n; ++i) {
      const int fd = events[i].data.fd;
      if (fd == wake_fd_) {
        uint64_t v;
        while (::read(wake_fd_, &v, sizeof v) > 0) {
        }
        continue;
      }
      auto it = waiting.find(fd);
      if (it == waiting.end()) continue;
      Conn& c = *it->second;
      if (!receive(c)) {
        close_conn(*forget(it));
        continue;
      }
      if (c.header_complete()) {
        dispatch(forget(it));
      } else if (c.pending() > limits_.max_header_bytes) {
        answer_and_forget(c.fd, 431, "Request Header Fields Too Large",
                          limit_error(431,
                                      fmt::format("the request header exceeds the limit of "
                                                  "{} KiB (--limits max_header_kib)",
                                                  limits_.max_header_bytes >> 10),
                                      "header_too_large"));
        {
          std::lock_guard lk(mu_);
          ++stats_.oversized_headers;
        }
        close_conn(*forget(it));
      }
    }
    const auto now = Clock::now();
    if (now >= next_scan) {
      next_scan = now + milliseconds(20);
      for (auto it = waiting.begin(); it != waiting.end();) {
        Conn& c = *it->second;
        if (now < c.deadline) {
          ++it;
          continue;
        }
        if (!c.idle) {  // an idle kept-alive connection just closes
          answer_and_forget(
              c.fd, 408, "Request Timeout",
              limit_error(408,
                          fmt::format("the request header did not arrive within {} ms "
                                      "(--limits header_timeout)",
                                      limits_.header_timeout_ms),
                          "header_timeout"));
          std::lock_guard lk(mu_);
          ++stats_.header_timeouts;
        }
        auto next = std::next(it);
        close_conn(*forget(it));
        it = next;
      }
    }
    std::lock_guard lk(mu_);
    stats_.waiting = int64_t(waiting.size());
  }
}

void GuardedServer::serve(const std::shared_ptr<Conn>& c) {
  const bool last = c->n_served + 1 >= limits_.keep_alive_max_requests || stopping_.load();
  bool connection_closed = false;
  bool ok = false;
  bool reusable = false;
  {
    ConnStream s(*c, limits_);
    ok = process_request(s, last, connection_closed, nullptr);
    reusable = s.reusable();
  }
  ++c->n_served;
  if (!ok || connection_closed || last || !reusable || stopping_.load()) return close_conn(*c);
  c->compact();
  c->idle = c->pending() == 0;
  c->deadline =
      Clock::now() + milliseconds(c->idle ? limits_.idle_timeout_ms : limits_.header_timeout_ms);
  wait_for_header(c);
}

}  // namespace kiln::server
