// engine/runtime.cpp: Runtime::open and the one place that decides which backend runs a
// model (device, tensor-parallel group, expert tiers) from typed, already-checked options.
#include "engine/runtime.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <variant>
#include <vector>

#include "backend/tp_group.h"
#include "core/log.h"
#include "core/progress.h"
#include "core/thread_pool.h"
#include "format/page_in.h"

namespace kiln {

Expected<Device> parse_device(std::string_view name) {
  if (name == "auto") return Device::Auto;
  if (name == "cpu") return Device::Cpu;
  if (name == "cuda") return Device::Cuda;
  return Status::errorf("unknown --device '{}' (auto, cuda or cpu)", name);
}

std::string cuda_refusal(const model::HParams& hp) {
  // The indexer reads its key plane on the host.
  if (hp.is_dsa())
    return fmt::format("DeepSeek sparse attention ('{}') runs on the CPU only", hp.arch_name);
  const int64_t row = int64_t(hp.mla.kv_lora) + hp.mla.rope;
  if (hp.is_mla() && row > kCudaMaxHeadDim)
    return fmt::format(
        "latent attention rows of {} values ('{}': kv_lora_rank {} + rope {}) are wider than "
        "the CUDA attention kernels take ({})",
        row, hp.arch_name, hp.mla.kv_lora, hp.mla.rope, kCudaMaxHeadDim);
  // Rows past kCudaNarrowHeadDim take the wide kernel, which reads them 8 values at a time.
  if (hp.is_mla() && row > kCudaNarrowHeadDim && row % 8 != 0)
    return fmt::format(
        "latent attention rows of {} values ('{}': kv_lora_rank {} + rope {}): the CUDA "
        "attention kernels take rows wider than {} only in multiples of 8",
        row, hp.arch_name, hp.mla.kv_lora, hp.mla.rope, kCudaNarrowHeadDim);
  return {};
}

Expected<EngineOptions> engine_options(const Config& config) {
  KILN_TRY(validate(config));
  EngineOptions o;
  o.threads = static_cast<int>(config.threads);
  KILN_ASSIGN_OR_RETURN(o.device, parse_device(config.device));
  if (config.tensor_parallel < 1 || config.tensor_parallel > 64)
    return Status::errorf("--tensor-parallel {}: must be 1..64", config.tensor_parallel);
  o.tensor_parallel = static_cast<int>(config.tensor_parallel);
  o.mlock = config.mlock;
  if (config.expert_cache < 0)
    return Status::errorf("--expert-cache {}: must not be negative", config.expert_cache);
  if (config.expert_cap < 0)
    return Status::errorf("--expert-cap {}: must not be negative", config.expert_cap);
  o.experts.cache_bytes = config.expert_cache;
  o.experts.cap = config.expert_cap;
  o.experts.prefetch = config.expert_prefetch;
  if (config.expert_device_cache < 0)
    return Status::errorf("--expert-device-cache {}: must not be negative",
                          config.expert_device_cache);
  o.expert_device_cache = static_cast<uint64_t>(config.expert_device_cache);
  // Checked on every device, so a typo fails where it is made, not on the next GPU run.
  const auto policy = parse_tier_eviction(config.expert_device_policy);
  if (!policy) return Status::errorf("--dev expert_device_policy: {}", policy.error());
  o.expert_device_policy = *policy;
  o.expert_device_async = config.expert_device_async;
  KILN_ASSIGN_OR_RETURN(o.routing, model::parse_routing(config.moe_routing));
  return o;
}

Expected<std::unique_ptr<Backend>> Runtime::make_backend(const Model& model,
                                                         const EngineOptions& o) {
  CpuOptions cpu = o.cpu;
  cpu.threads = o.threads;
  const bool streaming = o.experts.enabled();
  const int tp = o.tensor_parallel;
  if (tp < 1 || tp > 64) return Status::errorf("--tensor-parallel {}: must be 1..64", tp);
  if (tp > 1) {
    if (Status st = check_tensor_parallel(model, tp); !st)
      return Status::errorf("--tensor-parallel {}: {}", tp, st.message());
    if (streaming)
      return Status::error(
          "--tensor-parallel does not support MoE expert streaming "
          "(--expert-cache/--expert-cap)");
    if (o.device == Device::Cpu) {
      std::vector<std::unique_ptr<Backend>> ranks;
      const int threads = o.threads > 0 ? o.threads : ThreadPool::default_threads();
      cpu.threads = std::max(1, threads / tp);
      for (int r = 0; r < tp; ++r) ranks.push_back(make_cpu_backend(cpu));
      return make_host_tp_group(std::move(ranks));
    }
#if KILN_WITH_CUDA
    CudaOptions c = o.cuda;
    c.progress = o.progress;
    c.immutable_region = model.gguf().mapping()->bytes();  // norms/biases cached, not staged
    auto group = make_cuda_tp_group(tp, c);
    if (!group) return Status::errorf("--tensor-parallel {}: {}", tp, group.error());
    return std::move(*group);
#else
    return Status::errorf(
        "--tensor-parallel {} needs CUDA GPUs, and this kiln was built "
        "without CUDA (KILN_CUDA=OFF); --device cpu runs it on CPU backends",
        tp);
#endif
  }
#if KILN_WITH_CUDA
  // What the CUDA backend cannot run fails closed for an explicit --device cuda and stays on
  // the CPU for --device auto.
  const std::string refusal = cuda_refusal(model.hparams());
  const bool cuda_refuses = !refusal.empty();
  if (o.device == Device::Cuda && cuda_refuses) return Status::errorf("--device cuda: {}", refusal);
  if (o.device == Device::Auto && cuda_refuses && cuda_device_count() > 0)
    log_notice("device: {}; running on the CPU", refusal);
  if (!cuda_refuses &&
      (o.device == Device::Cuda || (o.device == Device::Auto && cuda_device_count() > 0))) {
    CudaOptions c = o.cuda;
    c.progress = o.progress;
    const GgufFile& f = model.gguf();
    if (streaming) {
      // Streamed experts live in the store's host slabs and reach the device through the
      // backend's expert tier: the file is not uploaded as a whole; dense weights are
      // uploaded on first use, norms cached from the mapping.
      c.immutable_region = f.mapping()->bytes();
      c.expert_cache_bytes = o.expert_device_cache;
      c.expert_policy = o.expert_device_policy;
      c.expert_async_copies = o.expert_device_async;
    } else {
      c.weight_region = f.mapping()->bytes().subspan(f.data_offset());
    }
    auto be = make_cuda_backend(c);
    if (be) {
      // Page-locks the store's slabs once, so the tier's copies are DMA.
      if (auto* store = dynamic_cast<moe::ExpertStore*>(model.weights().experts.get()))
        store->register_slabs(
            [b = be->get()](std::span<std::byte> m) { return b->register_host_memory(m); });
      return std::unique_ptr<Backend>(std::move(*be));
    }
    if (o.device == Device::Cuda) return Status::errorf("--device cuda: {}", be.error());
    log_notice("device: {}; running on the CPU", be.error());
  }
#else
  if (o.device == Device::Cuda)
    return Status::error("--device cuda: this kiln was built without CUDA (KILN_CUDA=OFF)");
#endif
  return make_cpu_backend(cpu);
}

std::unique_ptr<Backend> Runtime::make_reference_backend() { return make_ref_backend(); }

Expected<Runtime> Runtime::open(const std::string& path, const EngineOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  Runtime rt;
  rt.options_ = options;
  auto model = Model::load(path, {options.experts, options.routing});
  if (!model) return model.status();  // its message names the file
  rt.model_ = std::move(*model);
  // Paging a large model in takes a while: one line that counts up on a terminal, unless
  // the front end or --log-level (above notice) asks for quiet.
  const MappedFile& file = *rt.model_->gguf().mapping();
  const bool show = options.progress && log_level() <= LogLevel::notice && ::isatty(STDERR_FILENO);
  const std::string label =
      fmt::format("kiln: paging in {}", std::filesystem::path(path).filename().string());
  bool paged_in = false;
  if (options.mlock) {
    ProgressLine line(label, file.size(), stderr, show);
    const Status st = lock_in_ram(file, [&](uint64_t done, uint64_t) { line.update(done); });
    line.finish();
    if (!st) log_notice("--mlock: {}; the weights stay pageable", st.message());
    paged_in = st.is_ok();
  }
  auto tok = Tokenizer::from_gguf(rt.model_->gguf());
  if (!tok) return tok.status().context(fmt::format("{}: tokenizer", path));
  rt.tokenizer_ = std::make_unique<Tokenizer>(std::move(*tok));
  if (const GgufValue* v = rt.model_->gguf().find("tokenizer.chat_template");
      v && std::holds_alternative<std::string>(v->v)) {
    auto t = ChatTemplate::parse(v->str());
    if (t)
      rt.chat_template_.emplace(std::move(*t));
    else
      rt.chat_template_status_ =
          t.status().context(fmt::format("{}: tokenizer.chat_template", path));
  }
  KILN_ASSIGN_OR_RETURN(rt.backend_, make_backend(*rt.model_, options));
  // Host backends read the weights from the mapping: read it in now, as llama.cpp's loader
  // does (MAP_POPULATE), rather than a page fault at a time during the first prefill, with
  // nothing on screen. Not for device backends (the upload reads the file, with its own
  // progress), streamed experts (the file may exceed RAM: experts are read as routed), or a
  // file larger than the memory available (it would only evict itself). Where a quarter of the
  // available memory would still be left, the weights move into huge pages instead (decode
  // reads them faster there; they are then this process's, not evictable page cache).
  if (!paged_in && !rt.backend_->device_memory() && !options.experts.enabled()) {
    const uint64_t avail = memory_available();
    if (avail == 0 || file.size() <= avail) {
      ProgressLine line(label, file.size(), stderr, show);
      const auto step = [&](uint64_t done, uint64_t) { line.update(done); };
      rt.weights_moved_ =
          avail > 0 && file.size() <= avail / 4 * 3 && move_into_huge_pages(file, step);
      if (!rt.weights_moved_) page_in(file, step);
    } else {
      log_info(
          "{}: {:.1f} GiB, more than the {:.1f} GiB of memory available; its weights are "
          "read on first use",
          path, double(file.size()) / (1 << 30), double(avail) / (1 << 30));
    }
  }
  rt.load_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return rt;
}

Expected<const ChatTemplate*> Runtime::chat_template() const {
  if (!chat_template_status_) return chat_template_status_;
  return chat_template_ ? &*chat_template_ : nullptr;
}

Runtime::Runtime(Runtime&&) noexcept = default;
Runtime& Runtime::operator=(Runtime&&) noexcept = default;
Runtime::~Runtime() = default;

}  // namespace kiln
