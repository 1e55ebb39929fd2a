// apps/kiln/cmd_quantize.cpp: `kiln quantize IN.gguf OUT.gguf TYPE [--threads N]`: re-encodes a
// model's weights with llama.cpp's presets and per-tensor mixes, carrying all metadata over.
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "apps/kiln/commands.h"
#include "format/gguf.h"
#include "format/gguf_writer.h"
#include "quant/convert.h"
#include "quant/mix.h"
#include "quant/quant.h"

namespace kiln::app {
namespace {

constexpr uint32_t kQuantizationVersion = 2;  // ggml's GGML_QNT_VERSION

struct QuantizeArgs {
  std::string in, out, type;
  int threads = 0;
  bool allow_requantize = false;
};

// One stderr line redrawn in place on a terminal; plain lines otherwise (logs, CI).
class Progress {
 public:
  explicit Progress(size_t total) : total_(total), tty_(::isatty(STDERR_FILENO) != 0) {}
  void step(size_t done, const std::string& what) {
    constexpr int kWidth = 30;
    const int filled = total_ ? static_cast<int>(kWidth * done / total_) : kWidth;
    const std::string bar = std::string(static_cast<size_t>(filled), '#') +
                            std::string(static_cast<size_t>(kWidth - filled), ' ');
    fmt::print(stderr, "{}[{}] {:>4}/{} {:<60}{}", tty_ ? "\r" : "", bar, done, total_, what,
               tty_ ? "" : "\n");
    std::fflush(stderr);
  }
  void finish() {
    if (tty_) fmt::print(stderr, "\n");
  }

 private:
  size_t total_;
  bool tty_;
};

int fail(const std::string& msg) {
  fmt::print(stderr, "kiln quantize: {}\n", msg);
  return 1;
}

bool is_quantized(DType t) { return t != DType::F32 && t != DType::F16 && t != DType::BF16; }

int run_quantize(const QuantizeArgs& a) {
  const auto preset = quant::preset_from_name(a.type);
  if (!preset)
    return fail(fmt::format("unknown type '{}' (known: {})", a.type, quant::preset_names()));
  if (a.threads < 0) return fail(fmt::format("--threads must be >= 0, got {}", a.threads));
  const int threads = a.threads > 0
                          ? a.threads
                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));

  auto src = GgufFile::open(a.in);
  if (!src) return fail(src.error());
  auto plan = quant::plan_tensor_types(*preset, *src);
  if (!plan) return fail(fmt::format("{}: {}", a.in, plan.error()));

  const auto& tensors = src->tensors();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorInfo& t = tensors[i];
    const DType to = (*plan)[i];
    if (to == t.dtype) continue;
    if (!quant::can_dequantize(t.dtype))
      return fail(
          fmt::format("tensor '{}': cannot decode its type {}", t.name, dtype_name(t.dtype)));
    if (is_quantized(t.dtype) && !a.allow_requantize)
      return fail(
          fmt::format("tensor '{}' is already {}; re-quantizing loses quality "
                      "(pass --allow-requantize to do it anyway)",
                      t.name, dtype_name(t.dtype)));
  }

  GgufWriter w;
  w.copy_metadata(*src);
  w.set_u32("general.quantization_version", kQuantizationVersion);
  w.set_u32("general.file_type", static_cast<uint32_t>(preset->ftype));

  auto progress = std::make_shared<Progress>(tensors.size());
  auto done = std::make_shared<size_t>(0);
  uint64_t in_bytes = 0, out_bytes = 0;
  const GgufFile& g = *src;
  // Written in llama.cpp's order so that files match llama-quantize's byte for byte.
  for (size_t i : quant::llama_tensor_order(g)) {
    const TensorInfo& t = tensors[i];
    const DType to = (*plan)[i];
    std::vector<int64_t> ne(t.ne.begin(), t.ne.begin() + std::max(1, t.n_dims));
    in_bytes += t.n_bytes;
    out_bytes += *row_bytes(to, static_cast<uint64_t>(t.ne[0])) * static_cast<uint64_t>(t.n_rows());
    w.add_tensor_produced(
        t.name, to, ne, [&g, &t, to, threads, progress, done](std::span<std::byte> out) {
          progress->step(*done,
                         fmt::format("{} {} -> {}", t.name, dtype_name(t.dtype), dtype_name(to)));
          Status s =
              quant::convert_rows(t.dtype, to, t.ne[0], t.n_rows(), g.view(t).bytes, out, threads);
          ++*done;
          if (!s) return s.context(fmt::format("tensor '{}'", t.name));
          return Status::ok();
        });
  }
  const auto start = std::chrono::steady_clock::now();
  const Status s = w.write(a.out);
  progress->step(*done, s ? "done" : "failed");
  progress->finish();
  if (!s) return fail(s.message());
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  fmt::print(stderr,
             "kiln quantize: {} -> {} ({}): {:.2f} MiB -> {:.2f} MiB of tensor data in {:.2f} s\n",
             a.in, a.out, preset->name, in_bytes / 1048576.0, out_bytes / 1048576.0, secs);
  return 0;
}

}  // namespace

void add_quantize_command(CLI::App& app, int& exit_code) {
  auto* cmd =
      app.add_subcommand("quantize", "re-encode a GGUF model's weights (llama.cpp presets)");
  auto args = std::make_shared<QuantizeArgs>();
  cmd->add_option("input", args->in, "source GGUF file")->required();
  cmd->add_option("output", args->out, "GGUF file to write")->required();
  cmd->add_option("type", args->type, "preset: " + quant::preset_names())->required();
  cmd->add_option("--threads,-t", args->threads, "worker threads (default: all cores)");
  cmd->add_flag("--allow-requantize", args->allow_requantize,
                "allow re-encoding tensors that are already quantized");
  cmd->callback([args, &exit_code] { exit_code = run_quantize(*args); });
}

}  // namespace kiln::app
