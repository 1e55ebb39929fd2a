// bench/kvpack_bench.cpp: kvpack throughput without model compute: encode (gather rows +
// checksums), parse + install into a fresh cache, and the same stream through each transport
// on loopback (TCP, UCX when built) with the consumer installing as bytes arrive. Repetitions
// are interleaved so every figure sees the same machine load. Usage:
//   kvpack_bench [n_layer=32] [width=1024] [n_pos=4096] [reps=3]
// (the default is Llama-3-8B's KV shape: 32 layers x 8 KV heads x 128, f16).
#include <fmt/format.h>

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "kv/kvpack.h"
#include "transfer/transport.h"

using namespace kiln;
using Clock = std::chrono::steady_clock;

namespace {

double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}
// Process CPU seconds (all threads): on a loaded machine wall time measures the queue for a
// core, CPU time what the work itself costs.
double cpu_now() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}

KvConfig config(int n_layer, int64_t width, int32_t n_pos) {
  KvConfig c;
  c.n_ctx = n_pos;
  c.max_batch = 512;
  for (int l = 0; l < n_layer; ++l) c.layers.push_back({.width = width, .window = 0});
  return c;
}

Status install(std::span<const uint8_t> pack, const kvpack::Identity& id,
               std::span<const kvpack::LayerKind> kinds, const KvConfig& cfg) {
  KILN_ASSIGN_OR_RETURN(KvCache fresh, KvCache::create(cfg));
  KILN_ASSIGN_OR_RETURN(KvCache kv, kvpack::load(pack, id, kinds, std::move(fresh)));
  return kv.n_pos() == cfg.n_ctx ? Status::ok() : Status::error("wrong n_pos");
}

// Sends `pack` from a producer thread through a fresh connection; the consumer parses and
// installs while receiving. Seconds from connect to installed.
Expected<double> through(transfer::TransportKind kind, std::span<const uint8_t> pack,
                         const kvpack::Identity& id, std::span<const kvpack::LayerKind> kinds,
                         const KvConfig& cfg) {
  KILN_ASSIGN_OR_RETURN(auto listener, transfer::listen(kind, "127.0.0.1", 0));
  Status producer_status;
  std::thread producer([&] {
    auto link = listener->accept(transfer::Millis(10000));
    if (!link) {
      producer_status = link.status();
      return;
    }
    // Tile-sized sends, as a prefill node streams them.
    for (size_t off = 0; off < pack.size() && producer_status; off += size_t(4) << 20)
      producer_status = (*link)->send(
          pack.subspan(off, std::min(pack.size() - off, size_t(4) << 20)), transfer::Millis(10000));
    uint8_t ack = 0;
    if (producer_status)
      producer_status = transfer::recv_exact(**link, {&ack, 1}, transfer::Millis(10000));
  });
  const auto t0 = Clock::now();
  Status st;
  {
    auto link = transfer::connect(kind, "127.0.0.1", listener->port(), transfer::Millis(10000));
    if (!link) st = link.status();
    std::optional<kvpack::Installer> in;
    kvpack::Parser parser(
        [&](const kvpack::Header& h) -> Status {
          KILN_ASSIGN_OR_RETURN(KvCache fresh, KvCache::create(cfg));
          auto i = kvpack::Installer::begin(h, id, kinds, std::move(fresh));
          if (!i) return i.status();
          in.emplace(std::move(*i));
          return Status::ok();
        },
        [&](const kvpack::Tile& t) { return in->tile(t); });
    std::vector<uint8_t> buf(size_t(1) << 20);
    while (st && !parser.done()) {
      auto n = (*link)->recv(buf, transfer::Millis(10000));
      if (!n)
        st = n.status();
      else if (*n == 0)
        st = parser.finish();
      else
        st = parser.push({buf.data(), *n});
    }
    if (st) {
      auto kv = in->finish();
      if (!kv) st = kv.status();
    }
    const uint8_t ack = 1;
    if (st) st = (*link)->send({&ack, 1}, transfer::Millis(10000));
  }
  const double secs = since(t0);
  producer.join();
  KILN_TRY(st);
  KILN_TRY(producer_status);
  return secs;
}

}  // namespace

int main(int argc, char** argv) {
  const int n_layer = argc > 1 ? std::atoi(argv[1]) : 32;
  const int64_t width = argc > 2 ? std::atoll(argv[2]) : 1024;
  const int32_t n_pos = argc > 3 ? std::atoi(argv[3]) : 4096;
  const int reps = argc > 4 ? std::atoi(argv[4]) : 3;
  if (n_layer <= 0 || width <= 0 || n_pos <= 0 || reps <= 0) {
    fmt::print(stderr, "kvpack_bench: arguments must be > 0\n");
    return 1;
  }
  const KvConfig cfg = config(n_layer, width, n_pos);
  auto src = KvCache::create(cfg);
  if (!src) return fmt::print(stderr, "kvpack_bench: {}\n", src.error()), 1;
  for (int32_t done = 0; done < n_pos;) {
    const int32_t n = std::min(512, n_pos - done);
    if (!src->begin_append(n)) return 1;
    for (int l = 0; l < n_layer; ++l)
      for (int32_t r : src->append_rows(l))
        for (int64_t e = 0; e < width; ++e) {
          src->k_plane(l)[size_t(r) * size_t(width) + size_t(e)].bits = uint16_t(0x3000 + (r ^ e));
          src->v_plane(l)[size_t(r) * size_t(width) + size_t(e)].bits = uint16_t(0x3400 + (r + e));
        }
    src->commit();
    done += n;
  }
  const kvpack::Identity id{.engine_abi = 1, .kv_dtype = 1, .model = 1, .tokenizer = 2};
  std::vector<kvpack::LayerKind> kinds(size_t(n_layer),
                                       {.width = width, .window = 0, .rope = true});

  std::vector<transfer::TransportKind> links = {transfer::TransportKind::Tcp};
  if (transfer::ucx_built()) links.push_back(transfer::TransportKind::Ucx);
  std::vector<double> t_enc, t_load, c_enc, c_load;
  std::vector<std::vector<double>> t_link(links.size()), c_link(links.size());
  size_t bytes = 0;
  for (int r = 0; r < reps; ++r) {
    auto t0 = Clock::now();
    double c0 = cpu_now();
    auto pack = kvpack::save(*src, id, kinds, 512);
    t_enc.push_back(since(t0));
    c_enc.push_back(cpu_now() - c0);
    if (!pack) return fmt::print(stderr, "kvpack_bench: {}\n", pack.error()), 1;
    bytes = pack->size();
    t0 = Clock::now();
    c0 = cpu_now();
    if (Status s = install(*pack, id, kinds, cfg); !s)
      return fmt::print(stderr, "kvpack_bench: {}\n", s.message()), 1;
    t_load.push_back(since(t0));
    c_load.push_back(cpu_now() - c0);
    for (size_t i = 0; i < links.size(); ++i) {
      c0 = cpu_now();
      auto t = through(links[i], *pack, id, kinds, cfg);
      c_link[i].push_back(cpu_now() - c0);
      if (!t) return fmt::print(stderr, "kvpack_bench: {}\n", t.error()), 1;
      t_link[i].push_back(*t);
    }
  }
  auto best = [](const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); };
  fmt::print("kvpack_bench: {} layers x width {} x {} positions = {:.1f} MiB pack, best of {}\n",
             n_layer, width, n_pos, double(bytes) / (1 << 20), reps);
  fmt::print("  {:<36} {:>9} {:>9} {:>10} {:>10}\n", "", "wall s", "MB/s", "CPU s", "MB/CPU-s");
  auto line = [&](const char* what, double s, double c) {
    fmt::print("  {:<36} {:9.3f} {:9.0f} {:10.3f} {:10.0f}\n", what, s, double(bytes) / s / 1e6, c,
               double(bytes) / c / 1e6);
  };
  line("encode (gather + checksums)", best(t_enc), best(c_enc));
  line("parse + verify + install", best(t_load), best(c_load));
  for (size_t i = 0; i < links.size(); ++i)
    line(links[i] == transfer::TransportKind::Ucx ? "UCX loopback, streamed install (2 thr)"
                                                  : "TCP loopback, streamed install (2 thr)",
         best(t_link[i]), best(c_link[i]));
  return 0;
}
