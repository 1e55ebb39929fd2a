// transfer/session_pack.cpp: Session <-> kvpack, in memory, as a stream, and as a file.
#include "transfer/session_pack.h"

#include <cstdio>
#include <memory>

#include "transfer/identity.h"

namespace kiln::transfer {

Expected<std::vector<uint8_t>> save_session(const Session& session, int32_t max_tile_rows) {
  if (session.tp_size() > 1)
    return Status::error("kvpack: a tensor-parallel session's KV is split over its GPUs");
  const auto kinds = layer_kinds(session.model());
  return kvpack::save(session.kv_cache(), identity_of(session), kinds, max_tile_rows);
}

Expected<KvCache> fresh_cache_for(const Session& session) {
  const KvCache& kv = session.kv_cache();
  KvConfig cfg;
  cfg.n_ctx = kv.n_ctx();
  cfg.max_batch = kv.max_batch();
  for (int l = 0; l < kv.n_layers(); ++l)
    cfg.layers.push_back({.width = kv.width(l), .window = kv.window(l), .k_only = kv.k_only(l)});
  return KvCache::create(cfg);
}

StreamInstall::StreamInstall(Session& session)
    : session_(session),
      mine_(identity_of(session)),
      kinds_(layer_kinds(session.model())),
      parser_(
          [this](const kvpack::Header& h) -> Status {
            KILN_ASSIGN_OR_RETURN(KvCache fresh, fresh_cache_for(session_));
            auto in = kvpack::Installer::begin(h, mine_, kinds_, std::move(fresh));
            if (!in) return in.status();
            installer_.emplace(std::move(*in));
            return Status::ok();
          },
          [this](const kvpack::Tile& t) { return installer_->tile(t); }) {}

Status StreamInstall::push(std::span<const uint8_t> bytes) { return parser_.push(bytes); }

Status StreamInstall::publish() {
  KILN_TRY(parser_.finish());
  KILN_ASSIGN_OR_RETURN(KvCache kv, installer_->finish());
  installer_.reset();
  return session_.install_kv(std::move(kv));
}

Status load_session(Session& session, std::span<const uint8_t> pack) {
  StreamInstall in(session);
  KILN_TRY(in.push(pack));
  return in.publish();
}

namespace {
struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};
using File = std::unique_ptr<std::FILE, FileCloser>;
}  // namespace

Status save_session_file(const Session& session, const std::string& path) {
  KILN_ASSIGN_OR_RETURN(std::vector<uint8_t> pack, save_session(session));
  // Written beside the target and renamed, so a crash never leaves half a pack under `path`.
  const std::string tmp = path + ".tmp";
  File f(std::fopen(tmp.c_str(), "wb"));
  if (!f) return Status::errorf("kv save: cannot create '{}'", tmp);
  const bool ok =
      std::fwrite(pack.data(), 1, pack.size(), f.get()) == pack.size() && std::fflush(f.get()) == 0;
  f.reset();
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return Status::errorf("kv save: cannot write '{}'", path);
  }
  return Status::ok();
}

Status load_session_file(Session& session, const std::string& path) {
  File f(std::fopen(path.c_str(), "rb"));
  if (!f) return Status::errorf("kv load: cannot open '{}'", path);
  StreamInstall in(session);
  std::vector<uint8_t> buf(1 << 20);
  for (;;) {
    const size_t n = std::fread(buf.data(), 1, buf.size(), f.get());
    if (n == 0) break;
    if (Status s = in.push({buf.data(), n}); !s) return s.context(fmt::format("'{}'", path));
  }
  if (std::ferror(f.get())) return Status::errorf("kv load: read error on '{}'", path);
  if (Status s = in.publish(); !s) return s.context(fmt::format("'{}'", path));
  return Status::ok();
}

}  // namespace kiln::transfer
