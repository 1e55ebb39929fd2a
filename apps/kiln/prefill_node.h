// apps/kiln/prefill_node.h: the prefill node of disaggregated prefill (docs/kvpack.md): loads a
// model and, until SIGTERM/SIGINT, accepts decode nodes one at a time, prefills each one's
// prompt and streams its KV back as kvpack tiles. No HTTP: `kiln kv serve` runs it in builds
// without the server (the GPU machine's), `kiln serve --role prefill` in the others.
#pragma once

#include <signal.h>

#include <cstdint>
#include <string>

#include "core/config.h"
#include "core/status.h"

namespace kiln::app {

struct PrefillNodeOptions {
  std::string model_path;  // resolved already
  std::string host = "127.0.0.1";
  std::string transport = "tcp";  // tcp or ucx
  int port = 7070;
  int32_t chunk = 256;         // prompt tokens per forward step
  int64_t timeout_ms = 30000;  // a stalled decode node is dropped after this
};

// `sigs` (SIGTERM, SIGINT) must already be blocked in every thread; the node waits for one.
Status run_prefill_node(const PrefillNodeOptions& o, const Config& cfg, const sigset_t& sigs);

}  // namespace kiln::app
