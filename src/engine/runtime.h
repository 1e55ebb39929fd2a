// engine/runtime.h: one way to open a model for inference, shared by every front end (run,
// serve, bench, perplexity, kv, the prefill node) and by programs embedding kiln: the model,
// its tokenizer and chat template, and the backend the options ask for (device, tensor-
// parallel group, MoE expert tiers). Front ends never build a backend themselves.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "backend/backend.h"
#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/tier_policy.h"
#include "core/config.h"
#include "core/status.h"
#include "engine/session.h"
#include "moe/expert_store.h"
#include "model/routing.h"
#include "tokenizer/jinja/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace kiln {

enum class Device { Auto, Cpu, Cuda };
Expected<Device> parse_device(std::string_view name);  // "auto" | "cpu" | "cuda"

// Everything Runtime::open needs, typed. engine_options() fills it from the config registry
// (command line, KILN_* variables, --dev) and checks each value once, there.
struct EngineOptions {
  int threads = 0;  // CPU kernel threads; <= 0: one per core
  // Auto: CUDA when this build has it and a GPU is present (a refused GPU: one notice line,
  // then the CPU); Cuda: an error naming the reason when there is none.
  Device device = Device::Auto;
  int tensor_parallel = 1;   // ranks every layer is split over (1..64)
  bool mlock = false;        // lock the mapped weights in RAM; fails open with a notice
  moe::StoreConfig experts;  // streamed MoE experts (host slab tier); off by default
  // The CUDA expert tier (streamed experts only): device bytes (0: half the free memory),
  // eviction order, queued copies.
  uint64_t expert_device_cache = 0;
  TierEviction expert_device_policy = TierEviction::Lfu;
  bool expert_device_async = true;
  model::RoutingOverride routing;  // benchmarks only: MoE routing drawn, not the router's
  // Front ends sample from the backend's top-k candidates where the sampler allows (same ids);
  // false, whole logit rows (the tests that pin the two equal).
  bool device_sampling = true;
  bool progress = true;  // CUDA: print the weight upload's progress
  // Per-instance backend options, set in code (kernel switches for the tests that pin them).
  // The runtime sets cpu.threads from `threads` and the CUDA weight regions from the model.
  CpuOptions cpu;
  CudaOptions cuda = run_cuda_options();

  // CudaOptions{} with the default measured for whole runs on the H200 (docs/BENCHMARKS.md,
  // CUDA session 11): an f16 weight cache of a quarter of the free device memory for the
  // cuBLAS path. Same outputs either way.
  static CudaOptions run_cuda_options() {
    CudaOptions o;
    o.f16_cache_bytes = CudaOptions::kF16CacheAuto;
    return o;
  }
};
Expected<EngineOptions> engine_options(const Config& config);

// Why the CUDA backend cannot run a model of these hyperparameters, in one line; empty when it
// can. Latent attention attends over absorbed MQA rows of kv_lora + rope values (576 for
// DeepSeek-V3 and Kimi-K2), and the CUDA attention kernels take rows of at most
// kCudaMaxHeadDim, those wider than kCudaNarrowHeadDim in multiples of 8 (the deepseek2
// fixtures' 144 are golden-tested on a GPU by tests/cuda, 576-wide rows by its
// CudaMla tests). DeepSeek sparse attention (glm-dsa) stays on the CPU.
std::string cuda_refusal(const model::HParams& hp);

class Runtime {
 public:
  // Model::load (experts, routing) + mlock + tokenizer + chat template (when the file has
  // one) + the backend. Errors name the file, the option or the device at fault.
  static Expected<Runtime> open(const std::string& path, const EngineOptions& options);

  // The backend `options` ask for, for a model already loaded. A CUDA backend holds the
  // model's weights in device memory: it must not outlive `model`.
  static Expected<std::unique_ptr<Backend>> make_backend(const Model& model,
                                                         const EngineOptions& options);

  // The scalar reference backend (backend/ref): the oracle every fast backend is tested
  // against, for front ends that compare with it (kiln logits --device ref).
  static std::unique_ptr<Backend> make_reference_backend();

  const std::shared_ptr<const Model>& model() const { return model_; }
  Tokenizer& tokenizer() { return *tokenizer_; }
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  // The file's tokenizer.chat_template, parsed: nullptr when the file has none, the parse
  // error (naming the file) when it does not parse. Front ends that render chats (serve)
  // fail on the error; the others never need the template.
  Expected<const ChatTemplate*> chat_template() const;
  Backend& backend() const { return *backend_; }
  const EngineOptions& options() const { return options_; }
  double load_seconds() const { return load_seconds_; }
  // A host backend's weights were moved out of the file mapping into anonymous memory in huge
  // pages (format/page_in.h move_into_huge_pages): they count as anonymous, not file-backed.
  bool weights_in_anonymous_memory() const { return weights_moved_; }

  Runtime(Runtime&&) noexcept;
  Runtime& operator=(Runtime&&) noexcept;
  ~Runtime();

 private:
  Runtime() = default;
  EngineOptions options_;
  std::shared_ptr<const Model> model_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::optional<ChatTemplate> chat_template_;
  Status chat_template_status_;
  // Declared last: destroyed first, before the model whose weights it may hold.
  std::unique_ptr<Backend> backend_;
  double load_seconds_ = 0;
  bool weights_moved_ = false;
};

}  // namespace kiln
