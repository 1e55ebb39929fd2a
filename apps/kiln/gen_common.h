// apps/kiln/gen_common.h: what the generation commands (run, perplexity, bench, kv, serve)
// share beyond engine/runtime.h: finding the demo model, id hashes, resident-memory readings.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <span>
#include <string>

#include "core/config.h"
#include "core/status.h"
#include "engine/runtime.h"
#include "sampling/sampler.h"
#include "tokenizer/utf8_stream.h"

namespace kiln::app {

// `model` if given; else the demo model stories260K.gguf shipped with kiln: models/ beside the
// binary (the build tree), ../share/kiln/models (an installed tree), or, when --shared-dir is
// set, its testdata/models.
Expected<std::string> resolve_model_path(const std::string& model, const Config& config);

// The sampling options run and chat share (llama.cpp's spellings): --temp, --top-k, --top-p,
// --min-p, --repeat-penalty, --repeat-last-n, --presence-penalty, --frequency-penalty.
void add_sampling_options(CLI::App* cmd, SamplerParams& p);

// xxhash64 of the ids' little-endian int32 bytes, as 16 hex digits.
std::string hash_ids(std::span<const int32_t> ids);

// Resident set size of this process now (bytes), and the part of it that is file-backed
// (the mapped weights), from /proc/self/status; 0 where unavailable.
struct MemoryUse {
  uint64_t rss = 0, rss_file = 0, rss_anon = 0;
};
MemoryUse memory_use();

}  // namespace kiln::app
