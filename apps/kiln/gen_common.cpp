// apps/kiln/gen_common.cpp: shared pieces of the generation commands (see gen_common.h).
#include "apps/kiln/gen_common.h"

#include <fmt/format.h>
#include <unistd.h>
#include <xxhash.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/tier_policy.h"
#include "moe/expert_store.h"
#include "backend/cpu/kernels.h"
#include "backend/tp_group.h"
#include "core/thread_pool.h"
#include "core/log.h"
#if KILN_WITH_CUDA
#include "backend/cuda/cuda_backend.h"
#endif

namespace kiln::app {
namespace fs = std::filesystem;

Expected<std::string> resolve_model_path(const std::string& model, const Config& config) {
  if (!model.empty()) return model;
  const std::string rel = "testdata/models/stories260K.gguf";
  std::string shared = config.shared_dir;
  if (shared.empty()) {
    std::error_code ec;
    const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
    if (ec) return Status::error("no -m MODEL given and the kiln binary's path is unknown");
    // <repo>/build/<preset>/kiln -> <repo>/../shared
    shared = (exe.parent_path().parent_path().parent_path().parent_path() / "shared").string();
  }
  const fs::path p = fs::path(shared) / rel;
  if (!fs::exists(p))
    return Status::errorf("no -m MODEL given and the demo model '{}' does not exist (set "
                          "--shared-dir or KILN_SHARED_DIR)", p.string());
  return p.string();
}

moe::StoreConfig expert_store_config(const Config& config) {
  moe::StoreConfig c;
  c.cache_bytes = config.expert_cache;
  c.cap = config.expert_cap;
  c.prefetch = config.expert_prefetch;
  return c;
}

#if KILN_WITH_CUDA
// The CUDA kernel flags every CUDA backend of make_backend takes (one GPU or a TP group).
static Status apply_cuda_flags(const Config& config, CudaOptions& o) {
  o.progress = true;
  o.graphs = config.cuda_graphs;
  o.gemm_graphs = config.cuda_gemm_graphs;
  o.pdl = config.cuda_pdl;
  o.mma_pre_scales = config.cuda_mma_pre_scales;
  o.direct_download = config.cuda_direct_download;
  o.attention_skip_empty = config.cuda_attn_skip_empty;
  o.attention_warp_tiles = config.cuda_attn_warp_tiles;
  o.auto_int8_max_tokens = config.cuda_int8_max_tokens;
  o.int8_mma_min_tokens = config.cuda_int8_mma;
  o.fuse_rope = config.cuda_fuse_rope;
  o.fuse_swiglu = config.cuda_fuse_swiglu;
  if (config.cuda_l2_prefetch < 0 || config.cuda_l2_prefetch > 4096)
    return Status::errorf("--cuda-l2-prefetch {} must be 0 (off) to 4096 MiB",
                          config.cuda_l2_prefetch);
  o.l2_prefetch_bytes = uint64_t(config.cuda_l2_prefetch) << 20;
  if (config.cuda_f16_cache < -1)
    return Status::errorf("--cuda-f16-cache {} must be -1 (auto), 0 (off) or MiB",
                          config.cuda_f16_cache);
  o.f16_cache_bytes = config.cuda_f16_cache == -1 ? CudaOptions::kF16CacheAuto
                                                  : uint64_t(config.cuda_f16_cache) << 20;
  if (config.cuda_matmul == "v1") o.matmul = CudaMatmul::V1;
  else if (config.cuda_matmul == "v2") o.matmul = CudaMatmul::V2;
  else if (config.cuda_matmul == "v3") o.matmul = CudaMatmul::V3;
  else if (config.cuda_matmul != "auto")
    return Status::errorf("unknown --cuda-matmul '{}' (auto, v1, v2, v3)", config.cuda_matmul);
  return Status::ok();
}
#endif

Expected<std::unique_ptr<Backend>> make_backend(const Model& model, const Config& config) {
  const std::string& dev = config.device;
  if (dev != "auto" && dev != "cuda" && dev != "cpu")
    return Status::errorf("unknown --device '{}' (auto, cuda or cpu)", dev);
  const bool streaming = config.expert_cache > 0 || config.expert_cap > 0;
  // Checked on every device, so a typo fails where it is made, not on the next GPU run.
  const auto expert_policy = parse_tier_eviction(config.expert_device_policy);
  if (!expert_policy) return Status::errorf("--expert-device-policy: {}", expert_policy.error());
  const int64_t tp = config.tensor_parallel;
  if (tp < 1 || tp > 64) return Status::errorf("--tensor-parallel {}: must be 1..64", tp);
  if (tp > 1) {
    if (Status st = check_tensor_parallel(model, static_cast<int>(tp)); !st)
      return Status::errorf("--tensor-parallel {}: {}", tp, st.message());
    if (streaming)
      return Status::error("--tensor-parallel does not support MoE expert streaming "
                           "(--expert-cache/--expert-cap)");
    if (dev == "cpu") {
      std::vector<std::unique_ptr<Backend>> ranks;
      const int per_rank = std::max<int>(1, static_cast<int>(config.threads > 0
                                                                   ? config.threads
                                                                   : ThreadPool::default_threads()) /
                                                static_cast<int>(tp));
      for (int64_t r = 0; r < tp; ++r) ranks.push_back(make_cpu_backend({.threads = per_rank}));
      return make_host_tp_group(std::move(ranks));
    }
#if KILN_WITH_CUDA
    CudaOptions o;
    KILN_TRY(apply_cuda_flags(config, o));
    o.immutable_region = model.gguf().mapping()->bytes();  // norms/biases cached, not staged
    auto group = make_cuda_tp_group(static_cast<int>(tp), o);
    if (!group) return Status::errorf("--tensor-parallel {}: {}", tp, group.error());
    return std::move(*group);
#else
    return Status::errorf("--tensor-parallel {} needs CUDA GPUs, and this kiln was built "
                          "without CUDA (KILN_CUDA=OFF); --device cpu runs it on CPU backends",
                          tp);
#endif
  }
#if KILN_WITH_CUDA
  if (dev == "cuda" || (dev == "auto" && cuda_device_count() > 0)) {
    {
      CudaOptions o;
      const GgufFile& f = model.gguf();
      if (streaming) {
        // Streamed experts live in the store's host slabs and reach the device through the
        // backend's expert tier (CudaOptions::expert_cache_bytes): the file is not uploaded
        // as a whole; dense weights are uploaded on first use, norms cached from the mapping.
        if (config.expert_device_cache < 0)
          return Status::errorf("--expert-device-cache {}: must not be negative",
                                config.expert_device_cache);
        o.immutable_region = f.mapping()->bytes();
        o.expert_cache_bytes = static_cast<uint64_t>(config.expert_device_cache);
        o.expert_policy = *expert_policy;
        o.expert_async_copies = config.expert_device_async;
      } else {
        o.weight_region = f.mapping()->bytes().subspan(f.data_offset());
      }
      KILN_TRY(apply_cuda_flags(config, o));
      auto be = make_cuda_backend(o);
      if (be) {
        // Page-locks the store's slabs once, so the tier's copies are DMA.
        if (auto* store = dynamic_cast<moe::ExpertStore*>(model.weights().experts.get()))
          store->register_slabs(
              [b = be->get()](std::span<std::byte> m) { return b->register_host_memory(m); });
        return std::unique_ptr<Backend>(std::move(*be));
      }
      if (dev == "cuda") return Status::errorf("--device cuda: {}", be.error());
      log_notice("device: {}; running on the CPU", be.error());
    }
  }
#else
  (void)model;
  (void)streaming;
  if (dev == "cuda")
    return Status::error("--device cuda: this kiln was built without CUDA (KILN_CUDA=OFF)");
#endif
  return std::unique_ptr<Backend>(make_cpu_backend({.threads = static_cast<int>(config.threads)}));
}

Expected<Loaded> load_for_inference(const std::string& path, int threads) {
  Config c;
  c.threads = threads;
  return load_for_inference(path, c);
}

Expected<Loaded> load_for_inference(const std::string& path, const Config& config) {
  const auto t0 = std::chrono::steady_clock::now();
  Loaded out;
  KILN_ASSIGN_OR_RETURN(const model::RoutingOverride routing, model::parse_routing(config.moe_routing));
  auto model = Model::load(path, expert_store_config(config), routing);
  if (!model) return model.status();  // its message names the file
  out.model = std::move(*model);
  auto tok = Tokenizer::from_gguf(out.model->gguf());
  if (!tok) return tok.status().context(fmt::format("{}: tokenizer", path));
  out.tokenizer = std::make_unique<Tokenizer>(std::move(*tok));
  KILN_ASSIGN_OR_RETURN(out.backend, make_backend(*out.model, config));
  out.load_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

std::string hash_ids(std::span<const int32_t> ids) {
  std::vector<unsigned char> bytes;
  bytes.reserve(ids.size() * 4);
  for (int32_t id : ids) {
    const auto u = static_cast<uint32_t>(id);
    for (int k = 0; k < 4; ++k) bytes.push_back(static_cast<unsigned char>(u >> (8 * k)));
  }
  return fmt::format("{:016x}", XXH64(bytes.data(), bytes.size(), 0));
}

MemoryUse memory_use() {
  MemoryUse m;
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    unsigned long long kb = 0;
    if (std::sscanf(line.c_str(), "VmRSS: %llu", &kb) == 1) m.rss = kb * 1024;
    else if (std::sscanf(line.c_str(), "RssFile: %llu", &kb) == 1) m.rss_file = kb * 1024;
    else if (std::sscanf(line.c_str(), "RssAnon: %llu", &kb) == 1) m.rss_anon = kb * 1024;
  }
  return m;
}

}  // namespace kiln::app
