// transfer/transport.cpp: the in-memory Link pair (with fault injection) and TCP sockets.
#include "transfer/transport.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>

namespace kiln::transfer {

Expected<TransportKind> transport_from_name(std::string_view name) {
  if (name == "tcp") return TransportKind::Tcp;
  if (name == "ucx") {
    if (!ucx_built()) return Status::error("transport 'ucx': this build has no UCX (libucx-dev)");
    return TransportKind::Ucx;
  }
  return Status::errorf("unknown transport '{}' (expected tcp or ucx)", name);
}

bool ucx_built() {
#if KILN_HAVE_UCX
  return true;
#else
  return false;
#endif
}

Expected<std::unique_ptr<Listener>> listen(TransportKind kind, const std::string& host, int port) {
#if KILN_HAVE_UCX
  if (kind == TransportKind::Ucx) return ucx_listen(host, port);
#endif
  if (kind == TransportKind::Ucx) return Status::error("this build has no UCX transport");
  return tcp_listen(host, port);
}

Expected<std::unique_ptr<Link>> connect(TransportKind kind, const std::string& host, int port,
                                        Millis timeout) {
#if KILN_HAVE_UCX
  if (kind == TransportKind::Ucx) return ucx_connect(host, port, timeout);
#endif
  if (kind == TransportKind::Ucx) return Status::error("this build has no UCX transport");
  return tcp_connect(host, port, timeout);
}

Expected<std::pair<std::string, int>> parse_host_port(std::string_view text) {
  const size_t colon = text.rfind(':');
  if (colon == std::string_view::npos || colon == 0 || colon + 1 == text.size())
    return Status::errorf("'{}' is not HOST:PORT", text);
  int port = 0;
  const std::string_view p = text.substr(colon + 1);
  auto [end, ec] = std::from_chars(p.data(), p.data() + p.size(), port);
  if (ec != std::errc() || end != p.data() + p.size() || port <= 0 || port > 65535)
    return Status::errorf("'{}': port '{}' is not in 1..65535", text, p);
  return std::pair<std::string, int>(std::string(text.substr(0, colon)), port);
}

Status recv_exact(Link& link, std::span<uint8_t> buf, Millis timeout) {
  size_t got = 0;
  while (got < buf.size()) {
    auto n = link.recv(buf.subspan(got), timeout);
    if (!n) return n.status();
    if (*n == 0)
      return Status::errorf("{}: peer closed after {} of {} bytes", link.describe(), got,
                            buf.size());
    got += *n;
  }
  return Status::ok();
}

// ---------------------------------------------------------------- in-memory pair

namespace {

struct Pipe {
  std::mutex m;
  std::condition_variable cv;
  std::deque<uint8_t> q;
  bool closed = false;
  uint64_t sent = 0;
  MemoryFaults faults;
};

class MemoryLink final : public Link {
 public:
  MemoryLink(std::shared_ptr<Pipe> out, std::shared_ptr<Pipe> in, std::string name)
      : out_(std::move(out)), in_(std::move(in)), name_(std::move(name)) {}
  ~MemoryLink() override { close(); }

  Status send(std::span<const uint8_t> bytes, Millis) override {
    std::lock_guard lock(out_->m);
    if (out_->closed) return Status::errorf("{}: send after close", name_);
    for (uint8_t b : bytes) {
      const uint64_t i = out_->sent++;
      const MemoryFaults& f = out_->faults;
      if (i >= f.cut_after) {
        out_->closed = true;
        break;
      }
      if (i >= f.stall_after) continue;  // swallowed: the receiver waits forever
      out_->q.push_back(i == f.flip_at ? uint8_t(b ^ 1) : b);
    }
    out_->cv.notify_all();
    return Status::ok();
  }

  Expected<size_t> recv(std::span<uint8_t> buf, Millis timeout) override {
    std::unique_lock lock(in_->m);
    if (!in_->cv.wait_for(lock, timeout, [&] { return !in_->q.empty() || in_->closed; }))
      return Status::errorf("{}: timed out after {} ms waiting for the peer", name_,
                            timeout.count());
    size_t n = 0;
    while (n < buf.size() && !in_->q.empty()) {
      buf[n++] = in_->q.front();
      in_->q.pop_front();
    }
    return n;
  }

  void close() override {
    std::lock_guard lock(out_->m);
    out_->closed = true;
    out_->cv.notify_all();
  }
  std::string describe() const override { return name_; }

 private:
  std::shared_ptr<Pipe> out_, in_;
  std::string name_;
};

}  // namespace

std::pair<std::unique_ptr<Link>, std::unique_ptr<Link>> memory_pair(MemoryFaults faults) {
  auto a2b = std::make_shared<Pipe>(), b2a = std::make_shared<Pipe>();
  a2b->faults = faults;
  return {std::make_unique<MemoryLink>(a2b, b2a, "memory link"),
          std::make_unique<MemoryLink>(b2a, a2b, "memory link")};
}

// ---------------------------------------------------------------- TCP

namespace {

class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) reset(std::exchange(o.fd_, -1));
    return *this;
  }
  int get() const { return fd_; }
  void reset(int fd = -1) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_;
};

std::string errno_text() { return std::strerror(errno); }

// Waits for `events` on fd; false on timeout.
Expected<bool> wait_fd(int fd, short events, Millis timeout) {
  pollfd p{fd, events, 0};
  for (;;) {
    const int r = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(timeout.count(), INT32_MAX)));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return Status::errorf("poll: {}", errno_text());
    return r > 0;
  }
}

Expected<sockaddr_storage> resolve(const std::string& host, int port, socklen_t* len) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  const int rc =
      ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &res);
  if (rc != 0 || !res) return Status::errorf("cannot resolve '{}': {}", host, gai_strerror(rc));
  sockaddr_storage ss{};
  std::memcpy(&ss, res->ai_addr, res->ai_addrlen);
  *len = res->ai_addrlen;
  ::freeaddrinfo(res);
  return ss;
}

void tune(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
}

class TcpLink final : public Link {
 public:
  TcpLink(Fd fd, std::string name) : fd_(std::move(fd)), name_(std::move(name)) {}

  Status send(std::span<const uint8_t> bytes, Millis timeout) override {
    while (!bytes.empty()) {
      const ssize_t n = ::send(fd_.get(), bytes.data(), bytes.size(), MSG_NOSIGNAL);
      if (n > 0) {
        bytes = bytes.subspan(size_t(n));
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        KILN_ASSIGN_OR_RETURN(bool ready, wait_fd(fd_.get(), POLLOUT, timeout));
        if (!ready) return Status::errorf("{}: send timed out after {} ms", name_, timeout.count());
        continue;
      }
      return Status::errorf("{}: send: {}", name_, errno_text());
    }
    return Status::ok();
  }

  Expected<size_t> recv(std::span<uint8_t> buf, Millis timeout) override {
    for (;;) {
      const ssize_t n = ::recv(fd_.get(), buf.data(), buf.size(), 0);
      if (n >= 0) return size_t(n);
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK)
        return Status::errorf("{}: recv: {}", name_, errno_text());
      KILN_ASSIGN_OR_RETURN(bool ready, wait_fd(fd_.get(), POLLIN, timeout));
      if (!ready)
        return Status::errorf("{}: timed out after {} ms waiting for the peer", name_,
                              timeout.count());
    }
  }

  void close() override { ::shutdown(fd_.get(), SHUT_WR); }
  std::string describe() const override { return name_; }

 private:
  Fd fd_;
  std::string name_;
};

class TcpListener final : public Listener {
 public:
  TcpListener(Fd fd, int port) : fd_(std::move(fd)), port_(port) {}
  Expected<std::unique_ptr<Link>> accept(Millis timeout) override {
    KILN_ASSIGN_OR_RETURN(bool ready, wait_fd(fd_.get(), POLLIN, timeout));
    if (!ready) return Status::errorf("tcp accept: timed out after {} ms", timeout.count());
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    Fd c(::accept(fd_.get(), reinterpret_cast<sockaddr*>(&ss), &len));
    if (c.get() < 0) return Status::errorf("tcp accept: {}", errno_text());
    tune(c.get());
    char host[NI_MAXHOST] = "?", serv[NI_MAXSERV] = "?";
    ::getnameinfo(reinterpret_cast<sockaddr*>(&ss), len, host, sizeof host, serv, sizeof serv,
                  NI_NUMERICHOST | NI_NUMERICSERV);
    return std::unique_ptr<Link>(
        std::make_unique<TcpLink>(std::move(c), fmt::format("tcp peer {}:{}", host, serv)));
  }
  int port() const override { return port_; }

 private:
  Fd fd_;
  int port_;
};

}  // namespace

Expected<std::unique_ptr<Listener>> tcp_listen(const std::string& host, int port) {
  socklen_t len = 0;
  KILN_ASSIGN_OR_RETURN(sockaddr_storage ss, resolve(host, port, &len));
  Fd fd(::socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) return Status::errorf("tcp listen: socket: {}", errno_text());
  int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&ss), len) != 0)
    return Status::errorf("tcp listen on {}:{}: bind: {}", host, port, errno_text());
  if (::listen(fd.get(), 16) != 0)
    return Status::errorf("tcp listen on {}:{}: {}", host, port, errno_text());
  sockaddr_storage bound{};
  socklen_t blen = sizeof bound;
  ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &blen);
  const int actual = bound.ss_family == AF_INET6
                         ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                         : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  return std::unique_ptr<Listener>(std::make_unique<TcpListener>(std::move(fd), actual));
}

Expected<std::unique_ptr<Link>> tcp_connect(const std::string& host, int port, Millis timeout) {
  socklen_t len = 0;
  KILN_ASSIGN_OR_RETURN(sockaddr_storage ss, resolve(host, port, &len));
  Fd fd(::socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) return Status::errorf("tcp connect: socket: {}", errno_text());
  tune(fd.get());
  const std::string name = fmt::format("tcp {}:{}", host, port);
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&ss), len) != 0) {
    if (errno != EINPROGRESS) return Status::errorf("{}: connect: {}", name, errno_text());
    KILN_ASSIGN_OR_RETURN(bool ready, wait_fd(fd.get(), POLLOUT, timeout));
    if (!ready) return Status::errorf("{}: connect timed out after {} ms", name, timeout.count());
    int err = 0;
    socklen_t elen = sizeof err;
    ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &elen);
    if (err != 0) return Status::errorf("{}: connect: {}", name, std::strerror(err));
  }
  return std::unique_ptr<Link>(std::make_unique<TcpLink>(std::move(fd), name));
}

}  // namespace kiln::transfer
