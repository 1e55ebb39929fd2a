// kiln/kiln.h: the C++ API of a program that embeds kiln (as programs use llama.h): open a
// GGUF model on a device, tokenize, render a chat with the model's template, generate text
// with streaming. Self-contained: only standard headers; link the kiln_api library. Every
// failure is a Result holding one line that names what went wrong; nothing throws.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kiln::api {

// A value or one line of error text.
template <typename T>
class Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT: implicit, like std::expected
  static Result failure(std::string message) {
    Result r;
    r.error_ = std::move(message);
    return r;
  }
  explicit operator bool() const { return value_.has_value(); }
  T& operator*() { return *value_; }
  const T& operator*() const { return *value_; }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }
  const std::string& error() const { return error_; }

 private:
  Result() = default;
  std::optional<T> value_;
  std::string error_;
};

struct ModelOptions {
  std::string device = "auto";  // "auto" (a GPU when there is one), "cpu" or "cuda"
  int threads = 0;              // CPU kernel threads; 0: one per core
  int32_t n_ctx = 0;            // context of a generation; 0: min(training context, 4096)
};

struct GenerateOptions {
  int32_t max_tokens = 128;  // stops earlier at the end of generation
  float temperature = 0.8f;  // <= 0: greedy
  int32_t top_k = 40;        // <= 0: off
  float top_p = 0.95f;       // >= 1: off
  float min_p = 0.05f;       // <= 0: off
  uint64_t seed = 0;
};

struct Message {
  std::string role;  // system, user, assistant, ...
  std::string content;
};

struct Generation {
  std::string text;
  std::vector<int32_t> ids;
  bool end_of_generation = false;  // the model ended it (not max_tokens or the callback)
};

class Model {
 public:
  // Loads and validates `path` and the backend `options` ask for.
  static Result<std::unique_ptr<Model>> open(const std::string& path,
                                             const ModelOptions& options = {});
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  std::vector<int32_t> tokenize(std::string_view text, bool add_special = true) const;
  std::string detokenize(std::span<const int32_t> ids) const;
  // The prompt ids of a chat, rendered with the model's template (or a plain transcript when
  // the file has none), ready for generate().
  Result<std::vector<int32_t>> chat_prompt(std::span<const Message> messages) const;
  // Generates after `prompt` in a fresh context; `on_text` (optional) receives the text as it
  // is produced, whole UTF-8 characters only, and may return false to stop.
  Result<Generation> generate(std::span<const int32_t> prompt, const GenerateOptions& options,
                              const std::function<bool(std::string_view)>& on_text = {});
  Result<Generation> generate(std::string_view prompt, const GenerateOptions& options,
                              const std::function<bool(std::string_view)>& on_text = {});

  std::string_view architecture() const;  // "llama", "qwen3", ...
  std::string_view backend() const;       // "cpu", "cuda", ...
  int32_t n_vocab() const;

 private:
  struct Impl;
  explicit Model(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kiln::api
