// apps/kiln/prefill_node.cpp: the prefill node loop (see prefill_node.h).
#include "apps/kiln/prefill_node.h"

#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>

#include "apps/kiln/gen_common.h"
#include "core/log.h"
#include "transfer/remote_prefill.h"

namespace kiln::app {

Status run_prefill_node(const PrefillNodeOptions& o, const Config& cfg, const sigset_t& sigs) {
  KILN_ASSIGN_OR_RETURN(transfer::TransportKind kind, transfer::transport_from_name(o.transport));
  if (o.port < 0 || o.port > 65535)
    return Status::errorf("--kv-port {} must be in [0, 65535]", o.port);
  if (o.chunk < 1) return Status::errorf("--prefill-chunk {} must be >= 1", o.chunk);
  if (o.timeout_ms <= 0) return Status::errorf("--timeout-ms {} must be > 0", o.timeout_ms);
  KILN_ASSIGN_OR_RETURN(const EngineOptions eo, engine_options(cfg));
  KILN_ASSIGN_OR_RETURN(Runtime rt, Runtime::open(o.model_path, eo));
  KILN_ASSIGN_OR_RETURN(auto listener, transfer::listen(kind, o.host, o.port));
  fmt::print(stderr, "kiln: prefill node ({}), model {}, listening on {} {}:{}\n",
             rt.backend().name(), o.model_path, o.transport, o.host, listener->port());
  std::fflush(stderr);
  std::atomic<bool> stop{false};
  std::thread worker([&] {
    const transfer::ProducerOptions popt{.max_batch = o.chunk,
                                         .io_timeout = transfer::Millis(o.timeout_ms)};
    while (!stop.load()) {
      auto link = listener->accept(transfer::Millis(200));
      if (!link) continue;  // timeout: look at the stop flag again
      const auto t0 = std::chrono::steady_clock::now();
      Status s = transfer::serve_prefill(**link, rt.model(), rt.backend(), popt);
      const double secs =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (s)
        log_info("prefill for {} served in {:.3f} s", (*link)->describe(), secs);
      else
        log_notice("prefill for {} failed: {}", (*link)->describe(), s.message());
    }
  });
  int sig = 0;
  sigwait(&sigs, &sig);
  fmt::print(stderr, "kiln: prefill node: {} received, shutting down\n",
             sig == SIGTERM ? "SIGTERM" : "SIGINT");
  stop.store(true);
  worker.join();
  fmt::print(stderr, "kiln: prefill node stopped\n");
  return Status::ok();
}

}  // namespace kiln::app
