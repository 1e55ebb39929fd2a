// api/kiln_api.cpp: include/kiln/kiln.h over the engine: Runtime opens the model, a Session
// and a Sampler generate, the tokenizer streams whole characters. The only translation unit
// that sees both the public types and the internal ones.
#include "kiln/kiln.h"

#include <algorithm>

#include "engine/chat.h"
#include "engine/runtime.h"
#include "sampling/sampler.h"
#include "tokenizer/utf8_stream.h"

namespace kiln::api {

struct Model::Impl {
  Runtime rt;
  int32_t n_ctx = 0;
};

Model::Model(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Model::~Model() = default;

Result<std::unique_ptr<Model>> Model::open(const std::string& path, const ModelOptions& options) {
  using R = Result<std::unique_ptr<Model>>;
  EngineOptions eo;
  auto device = parse_device(options.device);
  if (!device) return R::failure(device.error());
  eo.device = *device;
  if (options.threads < 0) return R::failure("threads must be >= 0");
  eo.threads = options.threads;
  eo.progress = false;
  if (options.n_ctx < 0) return R::failure("n_ctx must be >= 0");
  auto rt = Runtime::open(path, eo);
  if (!rt) return R::failure(rt.error());
  const int32_t n_ctx =
      options.n_ctx > 0 ? options.n_ctx : std::min((*rt).model()->n_ctx_train(), 4096);
  return std::unique_ptr<Model>(new Model(std::make_unique<Impl>(Impl{std::move(*rt), n_ctx})));
}

std::vector<int32_t> Model::tokenize(std::string_view text, bool add_special) const {
  return impl_->rt.tokenizer().encode(text, add_special, /*parse_special=*/false);
}

std::string Model::detokenize(std::span<const int32_t> ids) const {
  return impl_->rt.tokenizer().decode(ids);
}

Result<std::vector<int32_t>> Model::chat_prompt(std::span<const Message> messages) const {
  using R = Result<std::vector<int32_t>>;
  auto tmpl = impl_->rt.chat_template();
  if (!tmpl) return R::failure(tmpl.error());
  std::vector<ChatMessage> chat;
  for (const Message& m : messages) chat.push_back({m.role, m.content});
  auto ids = kiln::chat_prompt(impl_->rt.tokenizer(), *tmpl, chat);
  if (!ids) return R::failure(ids.error());
  return std::move(*ids);
}

Result<Generation> Model::generate(std::string_view prompt, const GenerateOptions& options,
                                   const std::function<bool(std::string_view)>& on_text) {
  const std::vector<int32_t> ids = tokenize(prompt, /*add_special=*/true);
  return generate(ids, options, on_text);
}

Result<Generation> Model::generate(std::span<const int32_t> prompt, const GenerateOptions& options,
                                   const std::function<bool(std::string_view)>& on_text) {
  using R = Result<Generation>;
  const Tokenizer& tok = impl_->rt.tokenizer();
  if (prompt.empty()) return R::failure("empty prompt");
  if (options.max_tokens < 1) return R::failure("max_tokens must be >= 1");
  const int64_t need = int64_t(prompt.size()) + options.max_tokens;
  if (need > impl_->n_ctx)
    return R::failure("prompt (" + std::to_string(prompt.size()) + " tokens) + max_tokens " +
                      std::to_string(options.max_tokens) + " exceed the context of " +
                      std::to_string(impl_->n_ctx));
  SamplerParams sp;
  sp.temperature = options.temperature;
  sp.top_k = options.top_k;
  sp.top_p = options.top_p;
  sp.min_p = options.min_p;
  sp.seed = options.seed;
  auto sampler = Sampler::create(sp, impl_->rt.model()->n_vocab());
  if (!sampler) return R::failure(sampler.error());
  for (int32_t id : prompt) sampler->accept(id);
  Session session(impl_->rt.model(), impl_->rt.backend(), impl_->n_ctx);
  auto logits = session.eval(prompt, false);
  if (!logits) return R::failure(logits.error());
  Generation g;
  Utf8Stream stream;
  for (int32_t i = 0; i < options.max_tokens; ++i) {
    const int32_t id = sampler->sample(*logits);
    sampler->accept(id);
    g.ids.push_back(id);
    if (tok.is_eog(id)) {
      g.end_of_generation = true;
      break;
    }
    const std::string text = stream.push(tok.token_to_piece(id, /*special=*/false));
    g.text += text;
    if (!text.empty() && on_text && !on_text(text)) break;
    if (i + 1 == options.max_tokens) break;  // the last token needs no forward pass
    const int32_t next[1] = {id};
    logits = session.eval(next, false);
    if (!logits) return R::failure(logits.error());
  }
  const std::string rest = stream.flush();
  g.text += rest;
  if (!rest.empty() && on_text) on_text(rest);
  return g;
}

std::string_view Model::architecture() const { return impl_->rt.model()->arch_name(); }
std::string_view Model::backend() const { return impl_->rt.backend().name(); }
int32_t Model::n_vocab() const { return impl_->rt.model()->n_vocab(); }

}  // namespace kiln::api
