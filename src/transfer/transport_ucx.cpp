// transfer/transport_ucx.cpp: Link over UCX streams (ucp_stream_*), connection set up by
// sockaddr (TCP). UCX chooses the data path itself: TCP between hosts or namespaces, shared
// memory on one host, RDMA where present. Built only when libucx is found (CMake KILN_UCX).
#include <netdb.h>
#include <netinet/in.h>
#include <ucp/api/ucp.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>

#include "core/check.h"
#include "transfer/transport.h"

namespace kiln::transfer {
namespace {

using Clock = std::chrono::steady_clock;

// One UCP context + worker. Used from one thread at a time (UCS_THREAD_MODE_SINGLE): a
// listener and the links it accepted share it, and the producer serves one link at a time.
struct Worker {
  ucp_context_h ctx = nullptr;
  ucp_worker_h worker = nullptr;
  ~Worker() {
    if (worker) ucp_worker_destroy(worker);
    if (ctx) ucp_cleanup(ctx);
  }
  static Expected<std::shared_ptr<Worker>> create() {
    auto w = std::make_shared<Worker>();
    ucp_config_t* config = nullptr;
    if (ucs_status_t s = ucp_config_read(nullptr, nullptr, &config); s != UCS_OK)
      return Status::errorf("ucx: config: {}", ucs_status_string(s));
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_STREAM;
    ucs_status_t s = ucp_init(&params, config, &w->ctx);
    ucp_config_release(config);
    if (s != UCS_OK) return Status::errorf("ucx: init: {}", ucs_status_string(s));
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    if ((s = ucp_worker_create(w->ctx, &wp, &w->worker)) != UCS_OK)
      return Status::errorf("ucx: worker: {}", ucs_status_string(s));
    return w;
  }
  // Progresses until the request completes or the deadline passes; the request's status, or
  // UCS_ERR_TIMED_OUT after cancelling it (the request is freed either way).
  ucs_status_t wait(void* req, Clock::time_point deadline, size_t* recv_length = nullptr) {
    ucs_status_t st;
    while ((st = ucp_request_check_status(req)) == UCS_INPROGRESS) {
      if (ucp_worker_progress(worker) == 0 && Clock::now() > deadline) {
        ucp_request_cancel(worker, req);
        while (ucp_request_check_status(req) == UCS_INPROGRESS) ucp_worker_progress(worker);
        if (recv_length) *recv_length = 0;
        ucp_request_free(req);
        return UCS_ERR_TIMED_OUT;
      }
    }
    if (recv_length && st == UCS_OK) st = ucp_stream_recv_request_test(req, recv_length);
    ucp_request_free(req);
    return st;
  }
};

Expected<sockaddr_storage> resolve(const std::string& host, int port, socklen_t* len,
                                   bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  const int rc =
      ::getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &res);
  if (rc != 0 || !res)
    return Status::errorf("ucx: cannot resolve '{}': {}", host, gai_strerror(rc));
  sockaddr_storage ss{};
  std::memcpy(&ss, res->ai_addr, res->ai_addrlen);
  *len = res->ai_addrlen;
  ::freeaddrinfo(res);
  return ss;
}

class UcxLink final : public Link {
 public:
  UcxLink(std::shared_ptr<Worker> w, std::string name) : w_(std::move(w)), name_(std::move(name)) {}
  ~UcxLink() override {
    if (!ep_) return;
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = broken_ ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    void* r = ucp_ep_close_nbx(ep_, &p);
    if (r && !UCS_PTR_IS_ERR(r)) (void)w_->wait(r, Clock::now() + std::chrono::seconds(2));
  }

  // Creates the endpoint (from a connection request, or as a client of host:port).
  Status open(ucp_ep_params_t& ep) {
    ep.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = [](void* arg, ucp_ep_h, ucs_status_t) {
      static_cast<UcxLink*>(arg)->broken_ = true;
    };
    ep.err_handler.arg = this;
    if (ucs_status_t s = ucp_ep_create(w_->worker, &ep, &ep_); s != UCS_OK) {
      ep_ = nullptr;
      return Status::errorf("{}: endpoint: {}", name_, ucs_status_string(s));
    }
    return Status::ok();
  }

  Status send(std::span<const uint8_t> bytes, Millis timeout) override {
    if (bytes.empty()) return Status::ok();
    if (broken_) return Status::errorf("{}: connection lost", name_);
    ucp_request_param_t p{};
    void* r = ucp_stream_send_nbx(ep_, bytes.data(), bytes.size(), &p);
    if (r == nullptr) return Status::ok();
    if (UCS_PTR_IS_ERR(r))
      return Status::errorf("{}: send: {}", name_, ucs_status_string(UCS_PTR_STATUS(r)));
    const ucs_status_t s = w_->wait(r, Clock::now() + timeout);
    if (s == UCS_ERR_TIMED_OUT)
      return Status::errorf("{}: send timed out after {} ms", name_, timeout.count());
    if (s != UCS_OK) return Status::errorf("{}: send: {}", name_, ucs_status_string(s));
    return Status::ok();
  }

  Expected<size_t> recv(std::span<uint8_t> buf, Millis timeout) override {
    if (buf.empty()) return size_t(0);
    size_t length = 0;
    ucp_request_param_t p{};
    void* r = ucp_stream_recv_nbx(ep_, buf.data(), buf.size(), &length, &p);
    if (r == nullptr) return length;
    if (UCS_PTR_IS_ERR(r)) {
      // A peer that closed (or vanished) ends the stream.
      if (broken_) return size_t(0);
      return Status::errorf("{}: recv: {}", name_, ucs_status_string(UCS_PTR_STATUS(r)));
    }
    const ucs_status_t s = w_->wait(r, Clock::now() + timeout, &length);
    if (s == UCS_ERR_TIMED_OUT)
      return Status::errorf("{}: timed out after {} ms waiting for the peer", name_,
                            timeout.count());
    if (s != UCS_OK) {
      if (broken_) return size_t(0);
      return Status::errorf("{}: recv: {}", name_, ucs_status_string(s));
    }
    return length;
  }

  // UCX streams have no half-close; the protocol above never relies on end-of-stream for
  // success (kvpack and every message are self-delimiting), so closing flushes and releases.
  void close() override {}
  std::string describe() const override { return name_; }

 private:
  std::shared_ptr<Worker> w_;
  std::string name_;
  ucp_ep_h ep_ = nullptr;
  std::atomic<bool> broken_{false};
};

class UcxListener final : public Listener {
 public:
  ~UcxListener() override {
    if (!listener_) return;
    for (ucp_conn_request_h r : pending_) ucp_listener_reject(listener_, r);
    ucp_listener_destroy(listener_);
  }
  static Expected<std::unique_ptr<Listener>> create(const std::string& host, int port) {
    std::unique_ptr<UcxListener> l(new UcxListener());
    KILN_ASSIGN_OR_RETURN(l->w_, Worker::create());
    socklen_t len = 0;
    KILN_ASSIGN_OR_RETURN(sockaddr_storage ss, resolve(host, port, &len, true));
    ucp_listener_params_t lp{};
    lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&ss);
    lp.sockaddr.addrlen = len;
    lp.conn_handler.cb = [](ucp_conn_request_h req, void* arg) {
      static_cast<UcxListener*>(arg)->pending_.push_back(req);
    };
    lp.conn_handler.arg = l.get();
    if (ucs_status_t s = ucp_listener_create(l->w_->worker, &lp, &l->listener_); s != UCS_OK)
      return Status::errorf("ucx listen on {}:{}: {}", host, port, ucs_status_string(s));
    ucp_listener_attr_t attr{};
    attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    if (ucp_listener_query(l->listener_, &attr) == UCS_OK)
      l->port_ = ntohs(reinterpret_cast<sockaddr_in*>(&attr.sockaddr)->sin_port);
    return std::unique_ptr<Listener>(std::move(l));
  }

  Expected<std::unique_ptr<Link>> accept(Millis timeout) override {
    const auto deadline = Clock::now() + timeout;
    while (pending_.empty()) {
      if (ucp_worker_progress(w_->worker) == 0) {
        if (Clock::now() > deadline)
          return Status::errorf("ucx accept: timed out after {} ms", timeout.count());
      }
    }
    ucp_conn_request_h req = pending_.front();
    pending_.pop_front();
    auto link = std::make_unique<UcxLink>(w_, fmt::format("ucx peer of :{}", port_));
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST;
    ep.conn_request = req;
    KILN_TRY(link->open(ep));
    return std::unique_ptr<Link>(std::move(link));
  }
  int port() const override { return port_; }

 private:
  UcxListener() = default;
  std::shared_ptr<Worker> w_;
  ucp_listener_h listener_ = nullptr;
  std::deque<ucp_conn_request_h> pending_;
  int port_ = 0;
};

}  // namespace

Expected<std::unique_ptr<Listener>> ucx_listen(const std::string& host, int port) {
  return UcxListener::create(host, port);
}

Expected<std::unique_ptr<Link>> ucx_connect(const std::string& host, int port, Millis timeout) {
  KILN_ASSIGN_OR_RETURN(std::shared_ptr<Worker> w, Worker::create());
  socklen_t len = 0;
  KILN_ASSIGN_OR_RETURN(sockaddr_storage ss, resolve(host, port, &len, false));
  auto link = std::make_unique<UcxLink>(w, fmt::format("ucx {}:{}", host, port));
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR;
  ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&ss);
  ep.sockaddr.addrlen = len;
  KILN_TRY(link->open(ep));
  (void)timeout;  // the connection is made lazily; the first send carries the timeout
  return std::unique_ptr<Link>(std::move(link));
}

}  // namespace kiln::transfer
