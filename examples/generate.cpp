// examples/generate.cpp: the smallest program that embeds kiln through include/kiln/kiln.h:
// open a model, generate from a prompt (or a one-message chat with --chat), stream the text.
// Usage: kiln_example_generate MODEL.gguf PROMPT [max_tokens] [--chat]
// Greedy, so its text equals `kiln run -m MODEL -p PROMPT -n max_tokens --temp 0` (tested).
#include <kiln/kiln.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s MODEL.gguf PROMPT [max_tokens] [--chat]\n", argv[0]);
    return 2;
  }
  const bool chat = argc > 4 && std::string_view(argv[4]) == "--chat";
  auto model = kiln::api::Model::open(argv[1], {.device = "cpu"});
  if (!model) {
    std::fprintf(stderr, "error: %s\n", model.error().c_str());
    return 1;
  }
  kiln::api::GenerateOptions options;
  options.max_tokens = argc > 3 ? std::atoi(argv[3]) : 32;
  options.temperature = 0;  // greedy
  auto print = [](std::string_view text) {
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);
    return true;
  };
  kiln::api::Result<kiln::api::Generation> out =
      kiln::api::Result<kiln::api::Generation>::failure("");
  if (chat) {
    const kiln::api::Message messages[] = {{"user", argv[2]}};
    auto prompt = (*model)->chat_prompt(messages);
    if (!prompt) {
      std::fprintf(stderr, "error: %s\n", prompt.error().c_str());
      return 1;
    }
    out = (*model)->generate(*prompt, options, print);
  } else {
    out = (*model)->generate(std::string_view(argv[2]), options, print);
  }
  if (!out) {
    std::fprintf(stderr, "error: %s\n", out.error().c_str());
    return 1;
  }
  std::fprintf(stderr, "%zu tokens on %s (%s)%s\n", out->ids.size(),
               std::string((*model)->backend()).c_str(),
               std::string((*model)->architecture()).c_str(),
               out->end_of_generation ? ", end of generation" : "");
  return 0;
}
