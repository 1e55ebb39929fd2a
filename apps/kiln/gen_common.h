// apps/kiln/gen_common.h: what `kiln run`, `perplexity` and `bench` share: finding the demo
// model, loading model + tokenizer + CPU backend, id hashes, resident-memory readings.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "backend/backend.h"
#include "core/config.h"
#include "core/status.h"
#include "engine/session.h"
#include "moe/expert_store.h"
#include "apps/kiln/utf8_stream.h"
#include "tokenizer/tokenizer.h"

namespace kiln::app {

// `model` if given; else the demo model testdata/models/stories260K.gguf under
// config.shared_dir, or under <repo>/../shared where the running binary is
// <repo>/build/<preset>/kiln.
Expected<std::string> resolve_model_path(const std::string& model, const Config& config);

struct Loaded {
  std::shared_ptr<const Model> model;
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<Backend> backend;
  double load_seconds = 0;
};
// The backend `config.device` asks for: "cpu"; "cuda" (an error naming the reason when this
// build or machine has none); "auto" (default): CUDA when the build has it and a GPU is
// present, else the CPU, with one notice line when a GPU was present but refused. A CUDA
// backend holds the model's weights in device memory (must not outlive `model`).
Expected<std::unique_ptr<Backend>> make_backend(const Model& model, const Config& config);

// Model::load + Tokenizer::from_gguf + make_backend; errors name the file.
Expected<Loaded> load_for_inference(const std::string& path, int threads);
// Same, with the threads and MoE expert streaming options (--expert-cache/-cap/-prefetch)
// of `config`.
Expected<Loaded> load_for_inference(const std::string& path, const Config& config);
// The expert store's settings in `config` (moe/expert_store.h).
moe::StoreConfig expert_store_config(const Config& config);

// xxhash64 of the ids' little-endian int32 bytes, as 16 hex digits.
std::string hash_ids(std::span<const int32_t> ids);

// Resident set size of this process now (bytes), and the part of it that is file-backed
// (the mapped weights), from /proc/self/status; 0 where unavailable.
struct MemoryUse {
  uint64_t rss = 0, rss_file = 0, rss_anon = 0;
};
MemoryUse memory_use();

}  // namespace kiln::app
