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

namespace kiln::app {
namespace fs = std::filesystem;

Expected<std::string> resolve_model_path(const std::string& model, const Config& config) {
  if (!model.empty()) return model;
  const std::string name = "stories260K.gguf";
  std::vector<fs::path> tried;
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    tried.push_back(exe.parent_path() / "models" / name);                           // build tree
    tried.push_back(exe.parent_path().parent_path() / "share/kiln/models" / name);  // installed
  }
  if (!config.shared_dir.empty())
    tried.push_back(fs::path(config.shared_dir) / "testdata/models" / name);
  for (const fs::path& p : tried)
    if (fs::exists(p)) return p.string();
  return Status::errorf(
      "no -m MODEL given and the demo model {} is not where it is installed "
      "({}); give -m MODEL",
      name, tried.empty() ? std::string("?") : tried.front().string());
}

void add_sampling_options(CLI::App* cmd, SamplerParams& p) {
  cmd->add_option("--temp", p.temperature, "temperature; <= 0: greedy (default 0.8)");
  cmd->add_option("--top-k", p.top_k, "top-k, 0 = off (default 40)");
  cmd->add_option("--top-p", p.top_p, "top-p, 1 = off (default 0.95)");
  cmd->add_option("--min-p", p.min_p, "min-p, 0 = off (default 0.05)");
  cmd->add_option("--repeat-penalty", p.repeat_penalty, "repeat penalty (default 1)");
  cmd->add_option("--repeat-last-n", p.penalty_last_n, "penalty window (default 64)");
  cmd->add_option("--presence-penalty", p.presence_penalty, "presence penalty");
  cmd->add_option("--frequency-penalty", p.frequency_penalty, "frequency penalty");
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
    if (std::sscanf(line.c_str(), "VmRSS: %llu", &kb) == 1)
      m.rss = kb * 1024;
    else if (std::sscanf(line.c_str(), "RssFile: %llu", &kb) == 1)
      m.rss_file = kb * 1024;
    else if (std::sscanf(line.c_str(), "RssAnon: %llu", &kb) == 1)
      m.rss_anon = kb * 1024;
  }
  return m;
}

}  // namespace kiln::app
