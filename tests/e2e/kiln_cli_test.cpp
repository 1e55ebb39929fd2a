// tests/e2e/kiln_cli_test.cpp: runs the built `kiln` binary end to end: run (greedy text
// against llama.cpp's golden continuation, seeded sampling), perplexity (within 0.5 % of
// llama-perplexity), bench -o json, mkmodel output that loads and runs, and bad input that
// must end in one clear error line, never a crash.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "common/longrope_file.h"
#include "common/run_kiln.h"
#include "common/testdata.h"
#include "format/gguf.h"
#include "format/gguf_writer.h"
#include "tokenizer/tokenizer.h"

extern char** environ;

namespace kiln {
namespace {
using testing::kiln_binary;
using testing::model_path;
using testing::read_file;
using testing::shared_path;
using testing::source_path;

using Proc = testing::KilnProc;
using testing::expect_clean_error;
using testing::run_kiln;

nlohmann::json golden(const std::string& model) {
  return nlohmann::json::parse(read_file(shared_path("testdata/golden/" + model + ".json")));
}

std::string story_prompt() { return read_file(shared_path("testdata/prompts/story.txt")); }

// Greedy `kiln run` must reproduce llama.cpp's continuation up to the first near-tie.
void check_greedy(const std::string& model, double tie) {
  const nlohmann::json g = golden(model);
  const auto ids = g["greedy"].get<std::vector<int32_t>>();
  const auto margins = g["greedy_margins"].get<std::vector<double>>();
  size_t n_sure = 0;
  while (n_sure < margins.size() && margins[n_sure] >= tie) ++n_sure;
  // The token after the last sure step is still determined (its margin is the tie), so the
  // comparable prefix is up to and excluding the near-tie step.
  auto gguf = GgufFile::open(model_path(model + ".gguf"));
  ASSERT_TRUE(gguf) << gguf.error();
  auto tok = Tokenizer::from_gguf(*gguf);
  ASSERT_TRUE(tok) << tok.error();
  std::string expect;
  for (size_t i = 0; i < n_sure; ++i) expect += tok->token_to_piece(ids[i], false);
  ASSERT_GT(n_sure, 4u) << "golden data with too short a sure prefix to test anything";

  Proc p = run_kiln({"run", "-m", model_path(model + ".gguf"), "-p", story_prompt(), "-n",
                     std::to_string(ids.size()), "--temp", "0", "--threads", "2"});
  ASSERT_EQ(p.rc, 0) << p.err;
  size_t match = 0;
  while (match < expect.size() && match < p.out.size() && expect[match] == p.out[match]) ++match;
  std::printf(
      "%s: greedy text matches llama.cpp for %zu of %zu bytes (%zu sure tokens); "
      "full golden text %s\n",
      model.c_str(), match, expect.size(), n_sure,
      p.out.rfind(g["greedy_text"].get<std::string>(), 0) == 0 ? "matched" : "differs");
  EXPECT_EQ(p.out.substr(0, expect.size()), expect);
  EXPECT_NE(p.err.find("ids xxh64 "), std::string::npos);
  EXPECT_NE(p.err.find("decode"), std::string::npos);
}

TEST(KilnRun, GreedyStoryMatchesLlamaCpp) { check_greedy("stories260K", 0.05); }
TEST(KilnRun, GreedyStoryMatchesLlamaCppQ8) { check_greedy("stories260K-q8_0", 0.5); }

std::string hash_line(const std::string& err) {
  size_t at = err.find("ids xxh64 ");
  return at == std::string::npos ? "" : err.substr(at, 26);
}

TEST(KilnRun, SameSeedSameText) {
  auto go = [](const char* seed) {
    return run_kiln({"run", "-p", "Once upon a time", "-n", "40", "--temp", "1.0", "--seed", seed});
  };
  Proc a = go("7"), b = go("7"), c = go("8");
  ASSERT_EQ(a.rc, 0) << a.err;
  ASSERT_EQ(c.rc, 0) << c.err;
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(hash_line(a.err), hash_line(b.err));
  EXPECT_FALSE(hash_line(a.err).empty());
  EXPECT_NE(hash_line(a.err), hash_line(c.err)) << "different seeds gave identical 40 tokens";
}

// The options a person sets, and only those: `kiln serve --help` fits a screen (30 options at
// most), every default it prints is the real one, the developer door is not listed, and a
// developer key given to the wrong door is one line naming the right one.
TEST(KilnCli, ServeHelpIsShortAndTrue) {
  Proc h = run_kiln({"serve", "--help"});
  ASSERT_EQ(h.rc, 0) << h.err;
  size_t options = 0;
  std::istringstream lines(h.out);
  for (std::string line; std::getline(lines, line);)
    if (line.rfind("  -", 0) == 0) ++options;
  EXPECT_GE(options, 10u) << h.out;
  EXPECT_LE(options, 30u) << h.out;
  EXPECT_EQ(h.out.find("{false}"), std::string::npos) << h.out;
  EXPECT_EQ(h.out.find("{true}"), std::string::npos) << h.out;
  EXPECT_EQ(h.out.find("--cuda-"), std::string::npos) << h.out;
  EXPECT_EQ(h.out.find("--cpu-"), std::string::npos) << h.out;
  EXPECT_EQ(h.out.find("NAME=VALUE"), std::string::npos) << h.out;  // --dev is unlisted
  EXPECT_NE(h.out.find("-t,--threads"), std::string::npos) << h.out;
  EXPECT_NE(h.out.find("default auto"), std::string::npos) << h.out;  // --device
  Proc dev = run_kiln({"run", "--dev", "help"});
  ASSERT_EQ(dev.rc, 0) << dev.err;
  EXPECT_NE(dev.out.find("moe_routing=model"), std::string::npos) << dev.out;
  EXPECT_EQ(dev.out.find("cuda_"), std::string::npos) << dev.out;  // kernel switches: code only
  expect_clean_error(run_kiln({"run", "-p", "x", "--dev", "threads=2"}), "use --threads");
  expect_clean_error(run_kiln({"run", "-p", "x", "--dev", "cuda_graphs=1"}),
                     "unknown name 'cuda_graphs'");
  expect_clean_error(run_kiln({"run", "-p", "x", "--dev", "expert_device_policy=fifo"}),
                     "expert_device_policy");
  expect_clean_error(run_kiln({"run", "-p", "x", "--cuda-graphs"}), "--cuda-graphs");
}

// --mlock locks the mapped weights (or says in one notice line why it could not) and changes
// nothing else.
TEST(KilnRun, MlockChangesNothingButResidency) {
  const std::string model = testing::model_path("stories260K.gguf");
  Proc plain = run_kiln({"run", "-m", model, "-p", "Once upon a time", "-n", "16", "--temp", "0"});
  Proc locked = run_kiln(
      {"run", "-m", model, "-p", "Once upon a time", "-n", "16", "--temp", "0", "--mlock"});
  ASSERT_EQ(plain.rc, 0) << plain.err;
  ASSERT_EQ(locked.rc, 0) << locked.err;
  EXPECT_EQ(plain.out, locked.out);
  EXPECT_EQ(hash_line(plain.err), hash_line(locked.err));
}

// The figures of `kiln run`'s grammar line: decode passes, forced verify steps, drafted,
// accepted; empty when the line is missing.
std::vector<long> grammar_figures(const std::string& err) {
  static const std::regex line(
      R"(grammar: (\d+) decode passes; forced tokens: (\d+) verify steps, drafted (\d+), )"
      R"(accepted (\d+))");
  std::smatch m;
  if (!std::regex_search(err, m, line)) return {};
  return {std::stol(m[1]), std::stol(m[2]), std::stol(m[3]), std::stol(m[4])};
}

// Issue 35, point 3 in `kiln run`: the tokens a JSON schema forces (long property names) are
// drafted and verified in one pass each, as in `kiln serve`: the same text and ids as with
// --draft-n 0 (no forced drafts), greedy and sampled with a penalty, in fewer decode passes.
TEST(KilnRun, GrammarForcedTokensAreDraftedWithTheSameIds) {
  const std::string schema = R"({"type": "object", "properties": {
    "the_name_of_the_main_character_in_this_story": {"type": "string", "maxLength": 12},
    "how_many_friends_did_the_main_character_meet": {"type": "integer"},
    "did_the_story_have_a_happy_ending_for_everyone": {"type": "boolean"}},
    "required": ["the_name_of_the_main_character_in_this_story",
                 "how_many_friends_did_the_main_character_meet",
                 "did_the_story_have_a_happy_ending_for_everyone"]})";
  for (const std::vector<std::string>& sampling :
       {std::vector<std::string>{"--temp", "0"},
        std::vector<std::string>{"--temp", "0.8", "--repeat-penalty", "1.1", "--seed", "5"}}) {
    std::vector<std::string> args = {
        "run", "-m",  model_path("stories260K.gguf"), "-p", "Once upon a time", "-n", "400",
        "-j",  schema};
    args.insert(args.end(), sampling.begin(), sampling.end());
    std::vector<std::string> plain_args = args;
    plain_args.insert(plain_args.end(), {"--draft-n", "0"});
    const Proc plain = run_kiln(plain_args);
    const Proc drafted = run_kiln(args);
    ASSERT_EQ(plain.rc, 0) << plain.err;
    ASSERT_EQ(drafted.rc, 0) << drafted.err;
    EXPECT_NE(plain.out.find("\"how_many_friends_did_the_main_character_meet\""), std::string::npos)
        << plain.out;
    EXPECT_EQ(drafted.out, plain.out) << sampling[1];
    EXPECT_EQ(hash_line(drafted.err), hash_line(plain.err)) << sampling[1];
    const std::vector<long> p = grammar_figures(plain.err), d = grammar_figures(drafted.err);
    ASSERT_EQ(p.size(), 4u) << plain.err;
    ASSERT_EQ(d.size(), 4u) << drafted.err;
    EXPECT_EQ(p[1], 0) << plain.err;
    EXPECT_GT(d[3], 20) << drafted.err;
    EXPECT_EQ(d[3], d[2]) << drafted.err;  // the grammar's forced tokens always stand
    // Each kept draft is a decode pass saved (but one that ends the run, which needs no pass
    // after it either way).
    EXPECT_LT(d[0], p[0]) << plain.err << drafted.err;
    EXPECT_GE(p[0] - d[0] + 1, d[3]) << plain.err << drafted.err;
  }
}

// A model that cannot be read fails `kiln serve` in one line, before it listens (it used to
// listen, answer 503 forever and ignore SIGINT).
TEST(KilnServe, UnreadableModelFailsBeforeListening) {
  Proc p = run_kiln({"serve", "-m", "/nonexistent.gguf", "--port", "0"});
  expect_clean_error(p, "/nonexistent.gguf");
  EXPECT_EQ(p.err.find("listening"), std::string::npos) << p.err;
}

// llama.cpp's spellings: -f - reads the prompt from standard input, -n -1 generates until the
// end of generation or of the context, --seed -1 draws a seed and prints it.
// Sampling defaults of serve are checked by the request parser before anything listens.
TEST(KilnServe, BadSamplingDefaultsAreOneClearError) {
  const std::string m = model_path("stories260K.gguf");
  expect_clean_error(run_kiln({"serve", "-m", m, "--port", "0", "--temp", "3"}),
                     "--temp: 'temperature' = 3 is outside [0, 2]");
  expect_clean_error(run_kiln({"serve", "-m", m, "--port", "0", "--sampling", "top_k=-1"}),
                     "--sampling: 'top_k' = -1 is outside");
  expect_clean_error(run_kiln({"serve", "-m", m, "--port", "0", "--sampling", "max_tokens=5"}),
                     "--sampling 'max_tokens=5': expected KEY=VALUE");
  expect_clean_error(run_kiln({"serve", "-m", m, "--port", "0", "--sampling", "min_p=x"}),
                     "the value must be a number");
}

TEST(KilnRun, StdinPromptUnboundedLengthAndRandomSeed) {
  const std::string model = testing::model_path("stories260K.gguf");
  const std::string prompt = "Once upon a time";
  Proc arg = run_kiln({"run", "-m", model, "-p", prompt, "-n", "12", "--temp", "0"});
  Proc in = run_kiln({"run", "-m", model, "-f", "-", "-n", "12", "--temp", "0"}, &prompt);
  ASSERT_EQ(arg.rc, 0) << arg.err;
  ASSERT_EQ(in.rc, 0) << in.err;
  EXPECT_EQ(arg.out, in.out);
  Proc all = run_kiln({"run", "-m", model, "-p", prompt, "-n", "-1", "-c", "40", "--temp", "0"});
  ASSERT_EQ(all.rc, 0) << all.err;
  EXPECT_TRUE(all.err.find("generated 35 tokens") != std::string::npos ||
              all.err.find("(end of generation)") != std::string::npos)
      << all.err;
  Proc random = run_kiln({"run", "-m", model, "-p", prompt, "-n", "4", "--seed", "-1"});
  ASSERT_EQ(random.rc, 0) << random.err;
  EXPECT_NE(random.err.find("kiln run: seed "), std::string::npos) << random.err;
  expect_clean_error(run_kiln({"run", "-m", model, "-p", prompt, "-n", "-2"}), "-n -2");
  expect_clean_error(run_kiln({"run", "-m", model, "-p", prompt, "--seed", "-5"}), "--seed -5");
}

// kiln template --messages takes the JSON array itself, as its help says, or a file holding it.
TEST(KilnTemplate, MessagesInlineOrFromAFile) {
  const std::string tmpl = testing::shared_dir() + "/testdata/templates/Apertus-8B-Instruct.jinja";
  const std::string msgs = R"([{"role": "user", "content": "Hello there"}])";
  Proc inline_json =
      run_kiln({"template", "--template", tmpl, "--messages", msgs, "--add-generation-prompt"});
  ASSERT_EQ(inline_json.rc, 0) << inline_json.err;
  EXPECT_NE(inline_json.out.find("Hello there"), std::string::npos) << inline_json.out;
  const std::string file = testing::temp_dir() + "/messages.json";
  testing::write_file(file, msgs);
  Proc from_file =
      run_kiln({"template", "--template", tmpl, "--messages", file, "--add-generation-prompt"});
  ASSERT_EQ(from_file.rc, 0) << from_file.err;
  EXPECT_EQ(inline_json.out, from_file.out);
  expect_clean_error(run_kiln({"template", "--template", tmpl, "--messages", "[{\"x\": 1}]"}),
                     "--messages: message 0");
}

TEST(KilnRun, DemoModelIsTheDefault) {
  Proc p = run_kiln({"run", "-p", "Once upon a time", "-n", "8", "--temp", "0", "--stats"});
  ASSERT_EQ(p.rc, 0) << p.err;
  EXPECT_FALSE(p.out.empty());
  EXPECT_NE(p.err.find("stories260K.gguf"), std::string::npos) << p.err;
  // The copy shipped beside the binary, not ../shared's: a clone alone runs the demo.
  EXPECT_EQ(p.err.find("testdata/models"), std::string::npos) << p.err;
  EXPECT_NE(p.err.find("/models/stories260K.gguf"), std::string::npos) << p.err;
  EXPECT_NE(p.err.find("KV cache"), std::string::npos) << p.err;
}

TEST(KilnRun, BadInputIsOneClearError) {
  expect_clean_error(run_kiln({"run", "-p", ""}), "empty prompt");
  expect_clean_error(run_kiln({"run", "-p", "abc\xff\xfe def"}), "not valid UTF-8");
  expect_clean_error(run_kiln({"run", "-p", "Once \xe2\x96"}), "not valid UTF-8");
  expect_clean_error(run_kiln({"run", "-p", story_prompt(), "-c", "64"}),
                     "does not fit the context");
  expect_clean_error(run_kiln({"run", "-p", "Once upon a time", "-n", "5000", "-c", "256"}),
                     "exceeds the context");
  expect_clean_error(run_kiln({"run", "-p", "x", "-n", "0"}), "-n 0");
  expect_clean_error(run_kiln({"run", "-p", "x", "--top-p", "2"}), "top-p");
  expect_clean_error(run_kiln({"run", "-p", "x", "--logit-bias", "99999+1"}), "logit bias");
  expect_clean_error(run_kiln({"run", "-p", "x", "--logit-bias", "abc"}), "--logit-bias");
  expect_clean_error(run_kiln({"run", "-m", "/nonexistent/model.gguf", "-p", "x"}),
                     "/nonexistent/model.gguf");
  // A file that is not GGUF.
  expect_clean_error(
      run_kiln({"run", "-m", shared_path("testdata/text/gpl-3-head.txt"), "-p", "x"}),
      "gpl-3-head.txt");
}

TEST(KilnRun, LogitBiasBansToken) {
  // Ban the first greedy token; the output must change, and a +bias forces a token.
  const nlohmann::json g = golden("stories260K");
  const int32_t first = g["greedy"][0].get<int32_t>();
  Proc base = run_kiln({"run", "-p", story_prompt(), "-n", "1", "--temp", "0"});
  Proc banned = run_kiln({"run", "-p", story_prompt(), "-n", "1", "--temp", "0", "--logit-bias",
                          std::to_string(first) + "-inf"});
  ASSERT_EQ(base.rc, 0);
  ASSERT_EQ(banned.rc, 0) << banned.err;
  EXPECT_NE(hash_line(base.err), hash_line(banned.err));
}

// perplexity.json (shared, made with the golden data) lists the llama fixtures;
// tests/golden/perplexity_peer.json holds the peer's figures for every later architecture and
// quant type, computed the same way (its "command" says how). Every listed model must load.
static int check_perplexities(const std::string& json_path) {
  const auto j = nlohmann::json::parse(read_file(json_path));
  const std::string text = shared_path("testdata/" + j["text"].get<std::string>());
  int checked = 0;
  for (auto& [model, want_json] : j["ppl"].items()) {
    const double want = want_json.get<double>();
    Proc p = run_kiln({"perplexity", "-m", model_path(model), "-f", text, "-c", "128"});
    EXPECT_EQ(p.rc, 0) << model << ": " << p.err;
    const size_t at = p.out.find("Final estimate: PPL = ");
    EXPECT_NE(at, std::string::npos) << model << ": " << p.out;
    if (p.rc != 0 || at == std::string::npos) continue;
    const double got = std::stod(p.out.substr(at + 22));
    std::printf("%s: PPL %.4f vs llama.cpp %.4f (%+.3f %%)\n", model.c_str(), got, want,
                100 * (got - want) / want);
    EXPECT_NEAR(got, want, 0.005 * want) << model;
    ++checked;
  }
  return checked;
}

TEST(KilnPerplexity, WithinHalfPercentOfLlamaCpp) {
  EXPECT_EQ(check_perplexities(shared_path("testdata/golden/perplexity.json")), 6);
}

TEST(KilnPerplexity, NewArchitecturesWithinHalfPercentOfLlamaCpp) {
  EXPECT_GE(check_perplexities(source_path("tests/golden/perplexity_peer.json")), 23);
}

// LongRoPE chooses its factor set by the context a sequence gets (llama.cpp: long once n_ctx
// passes rope.scaling.original_context_length), not by the training context: phi3-f16 with two
// factor sets and an original context of 256 (training 512, common/longrope_file.h), against
// the peer's figures for this very file at -c 256 (short set) and -c 512 (long set).
TEST(KilnPerplexity, LongRopeFactorSetFollowsTheContext) {
  auto src = GgufFile::open(model_path("phi3-f16.gguf"));
  ASSERT_TRUE(src.has_value()) << src.error();
  const testing::LongRopeFile lr = testing::phi3_with_longrope(*src, 256);
  const GgufWriter& w = lr.writer;
  const std::string dir = testing::temp_dir();
  const std::string file = dir + "/phi3-longrope.gguf";
  ASSERT_TRUE(w.write(file).ok()) << file;
  const auto j = nlohmann::json::parse(read_file(source_path("tests/golden/perplexity_peer.json")));
  const std::string text = shared_path("testdata/" + j["text"].get<std::string>());
  for (auto& [ctx, want_json] : j["longrope"]["ppl"].items()) {
    const double want = want_json.get<double>();
    Proc p = run_kiln({"perplexity", "-m", file, "-f", text, "-c", ctx});
    ASSERT_EQ(p.rc, 0) << p.err;
    const size_t at = p.out.find("Final estimate: PPL = ");
    ASSERT_NE(at, std::string::npos) << p.out;
    const double got = std::stod(p.out.substr(at + 22));
    std::printf("phi3-longrope -c %s: PPL %.4f vs llama.cpp %.4f (%+.3f %%)\n", ctx.c_str(), got,
                want, 100 * (got - want) / want);
    EXPECT_NEAR(got, want, 0.005 * want) << "-c " << ctx << " (file kept: " << file << ")";
  }
  if (!HasFailure()) std::filesystem::remove_all(dir);
}

TEST(KilnPerplexity, TooShortTextIsAnError) {
  const std::string dir = testing::temp_dir();
  const std::string f = dir + "/short.txt";
  FILE* fp = std::fopen(f.c_str(), "w");
  std::fputs("Just a few words.", fp);
  std::fclose(fp);
  expect_clean_error(run_kiln({"perplexity", "-f", f, "-c", "128"}), "needs at least");
  expect_clean_error(run_kiln({"perplexity", "-f", dir + "/missing.txt"}), "missing.txt");
  std::filesystem::remove_all(dir);
}

TEST(KilnBench, JsonParses) {
  Proc p = run_kiln({"bench", "-p", "32", "-n", "8", "-r", "2", "-o", "json", "--threads", "2"});
  ASSERT_EQ(p.rc, 0) << p.err;
  auto j = nlohmann::json::parse(p.out);
  ASSERT_TRUE(j.is_array());
  ASSERT_EQ(j.size(), 2u);
  EXPECT_EQ(j[0]["test"], "pp32");
  EXPECT_EQ(j[1]["test"], "tg8");
  for (auto& r : j) {
    EXPECT_EQ(r["samples_ts"].size(), 2u);
    EXPECT_GT(r["avg_ts"].get<double>(), 0);
    EXPECT_GT(r["model_size"].get<double>(), 0);
  }
  EXPECT_GT(j[1]["weight_gbps"].get<double>(), 0);
  expect_clean_error(run_kiln({"bench", "-o", "xml"}), "md or json");
}

// llama-bench's -d: each test after a prefix of that many tokens in the cache, named
// "tgN @ dD" (the prefix untimed, so a deeper cache may not lose its pp and tg tests).
TEST(KilnBench, DepthListRunsEveryTestAtEachDepth) {
  Proc p = run_kiln({"bench", "-p", "16", "-n", "4", "-d", "0,24", "--n-seq", "2", "-r", "1", "-o",
                     "json", "--threads", "2"});
  ASSERT_EQ(p.rc, 0) << p.err;
  auto j = nlohmann::json::parse(p.out);
  ASSERT_TRUE(j.is_array());
  std::vector<std::string> tests;
  for (auto& r : j) {
    tests.push_back(r["test"].get<std::string>());
    EXPECT_EQ(r["n_depth"].get<int>(), tests.back().find("@ d24") != std::string::npos ? 24 : 0);
    EXPECT_GT(r["avg_ts"].get<double>(), 0) << tests.back();
  }
  EXPECT_EQ(tests, (std::vector<std::string>{"pp16", "tg4", "pp16 @ d24", "tg4 @ d24", "tg4 x2",
                                             "tg4 x2 @ d24"}));
  expect_clean_error(run_kiln({"bench", "--n-depth=-1"}), "-d -1");
}

TEST(KilnMkmodel, OutputLoadsAndRunsAndIsDeterministic) {
  const std::string dir = testing::temp_dir();
  const std::vector<std::string> shape = {"--n-embd", "256", "--n-layer",   "3", "--n-ff",    "512",
                                          "--n-head", "4",   "--n-head-kv", "2", "--n-vocab", "600",
                                          "--seed",   "9"};
  for (const char* type : {"f16", "q8_0", "q4_k_m"}) {
    SCOPED_TRACE(type);
    const std::string out = dir + "/m-" + type + ".gguf";
    std::vector<std::string> args = {"mkmodel", "-o", out, "--type", type, "--threads", "2"};
    args.insert(args.end(), shape.begin(), shape.end());
    Proc m = run_kiln(args);
    ASSERT_EQ(m.rc, 0) << m.err;
    auto g = GgufFile::open(out);
    ASSERT_TRUE(g) << g.error();
    auto q = g->find_tensor("blk.0.ffn_gate.weight");
    ASSERT_NE(q, nullptr);
    EXPECT_EQ(q->dtype, std::string(type) == "f16"    ? DType::F16
                        : std::string(type) == "q8_0" ? DType::Q8_0
                                                      : DType::Q4_K);
    // The vocabulary round-trips text through the tokenizer.
    auto tok = Tokenizer::from_gguf(*g);
    ASSERT_TRUE(tok) << tok.error();
    EXPECT_EQ(tok->n_vocab(), 600);
    EXPECT_EQ(tok->decode(tok->encode("hello world, 42!", false, false)), "hello world, 42!");
    Proc r = run_kiln({"run", "-m", out, "-p", "hello world", "-n", "6", "--temp", "0"});
    EXPECT_EQ(r.rc, 0) << r.err;
    EXPECT_NE(r.err.find("generated"), std::string::npos);
    // Same seed, different thread count: byte-identical file.
    const std::string again = dir + "/again.gguf";
    args[2] = again;
    args[6] = "1";
    ASSERT_EQ(run_kiln(args).rc, 0);
    EXPECT_EQ(read_file(out), read_file(again));
  }
  expect_clean_error(run_kiln({"mkmodel", "-o", dir + "/x.gguf", "--type", "q9_9"}), "--type");
  expect_clean_error(run_kiln({"mkmodel", "-o", dir + "/x.gguf", "--n-embd", "100"}), "--n-head");
  expect_clean_error(run_kiln({"mkmodel", "-o", dir + "/x.gguf", "--arch", "gpt9"}), "--arch");
  expect_clean_error(run_kiln({"mkmodel", "-o", dir + "/x.gguf", "--n-vocab", "10"}), "--n-vocab");
  std::filesystem::remove_all(dir);
}

// The deepseek2 shape (latent attention, a leading dense layer, then MoE with a shared expert)
// loads, runs, and reports its latent cache: (kv_lora + rope) f16 values per token and layer.
TEST(KilnMkmodel, Deepseek2LoadsRunsAndKeepsALatentCache) {
  const std::string dir = testing::temp_dir();
  for (const char* type : {"f16", "q4_k_m"}) {
    SCOPED_TRACE(type);
    const std::string out = dir + "/ds-" + type + ".gguf";
    Proc m = run_kiln({"mkmodel", "-o",         out,         "--type",          type,  "--threads",
                       "2",       "--arch",     "deepseek2", "--n-embd",        "256", "--n-layer",
                       "3",       "--n-ff",     "512",       "--n-head",        "4",   "--head-dim",
                       "48",      "--n-rot",    "16",        "--kv-lora",       "64",  "--q-lora",
                       "96",      "--n-expert", "8",         "--n-expert-used", "2",   "--n-ff-exp",
                       "128",     "--n-vocab",  "600"});
    ASSERT_EQ(m.rc, 0) << m.err;
    auto g = GgufFile::open(out);
    ASSERT_TRUE(g) << g.error();
    EXPECT_NE(g->find_tensor("blk.0.ffn_gate.weight"), nullptr);      // the dense lead
    EXPECT_NE(g->find_tensor("blk.1.ffn_up_shexp.weight"), nullptr);  // MoE after it
    EXPECT_NE(g->find_tensor("blk.2.attn_k_b.weight"), nullptr);
    Proc r = run_kiln({"run", "-m", out, "-p", "hello world", "-n", "6", "--temp", "0", "--stats"});
    ASSERT_EQ(r.rc, 0) << r.err;
    // 3 layers x (64 + 16) values x 2 bytes, no V plane.
    EXPECT_NE(r.err.find("(480 bytes per token)"), std::string::npos) << r.err;
  }
  std::filesystem::remove_all(dir);
}

// The glm4moe shape (GLM-4.5: q/k/v biases, QK-norm, half-rotary heads, a leading dense layer,
// then the sigmoid-routed MoE with a shared expert, and one NextN block after the main layers,
// counted in block_count) loads and runs; its NextN block is loaded, not cached by the main
// pass, and drafts under --spec-mtp with the same greedy ids as plain decoding.
TEST(KilnMkmodel, Glm4moeLoadsRunsAndDraftsWithItsNextnBlock) {
  const std::string dir = testing::temp_dir();
  for (const char* type : {"f16", "q4_k_m"}) {
    SCOPED_TRACE(type);
    const std::string out = dir + "/glm-" + type + ".gguf";
    Proc m = run_kiln({"mkmodel", "-o",         out,       "--type",          type,  "--threads",
                       "2",       "--arch",     "glm4moe", "--n-embd",        "256", "--n-layer",
                       "3",       "--n-ff",     "512",     "--n-head",        "4",   "--n-head-kv",
                       "2",       "--n-expert", "8",       "--n-expert-used", "2",   "--n-ff-exp",
                       "128",     "--n-vocab",  "600"});
    ASSERT_EQ(m.rc, 0) << m.err;
    auto g = GgufFile::open(out);
    ASSERT_TRUE(g) << g.error();
    auto u32 = [&](const char* key) {
      auto v = g->get<uint32_t>(key);
      return v ? *v : 0u;
    };
    EXPECT_EQ(u32("glm4moe.block_count"), 4u);
    EXPECT_EQ(u32("glm4moe.nextn_predict_layers"), 1u);
    EXPECT_EQ(u32("glm4moe.rope.dimension_count"), 32u);          // half of each 64-wide head
    EXPECT_NE(g->find_tensor("blk.0.ffn_gate.weight"), nullptr);  // the dense lead
    EXPECT_NE(g->find_tensor("blk.1.exp_probs_b.bias"), nullptr);
    EXPECT_NE(g->find_tensor("blk.1.ffn_up_shexp.weight"), nullptr);
    EXPECT_NE(g->find_tensor("blk.2.attn_k.bias"), nullptr);
    EXPECT_NE(g->find_tensor("blk.2.attn_q_norm.weight"), nullptr);
    EXPECT_NE(g->find_tensor("blk.2.post_attention_norm.weight"), nullptr);
    EXPECT_EQ(g->find_tensor("blk.2.ffn_norm.weight"), nullptr);
    EXPECT_NE(g->find_tensor("blk.3.nextn.eh_proj.weight"), nullptr);
    EXPECT_NE(g->find_tensor("blk.3.ffn_gate_exps.weight"), nullptr);
    const std::vector<std::string> base = {"run", "-m", out,      "-p", "hello world",
                                           "-n",  "12", "--temp", "0",  "--stats"};
    Proc r = run_kiln(base);
    ASSERT_EQ(r.rc, 0) << r.err;
    // 3 main layers x K and V x 2 KV heads x 64 values x 2 bytes: the NextN block has no
    // rows in the main cache.
    EXPECT_NE(r.err.find("(1536 bytes per token)"), std::string::npos) << r.err;
    std::vector<std::string> spec = base;
    spec.insert(spec.end(), {"--spec-mtp", "--draft-n", "2"});
    Proc d = run_kiln(spec);
    ASSERT_EQ(d.rc, 0) << d.err;
    EXPECT_EQ(d.out, r.out);
    EXPECT_NE(d.err.find("speculative (mtp, k=2)"), std::string::npos) << d.err;
  }
  expect_clean_error(run_kiln({"mkmodel", "-o", dir + "/x.gguf", "--arch", "glm4moe"}),
                     "--n-expert");
  expect_clean_error(run_kiln({"mkmodel", "-o", dir + "/x.gguf", "--arch", "glm4moe", "--n-expert",
                               "4", "--n-expert-used", "2", "--n-nextn", "-1"}),
                     "--n-nextn");
  std::filesystem::remove_all(dir);
}

// A dflash drafter written for a llama target of the same width and vocabulary loads beside it
// (its keys, tensors and target layers pass load_dflash's fail-closed checks) and drafts under
// --dflash with the target's greedy ids; it carries no embedding, output or vocabulary.
TEST(KilnMkmodel, DflashDrafterFitsItsTargetAndKeepsGreedyIds) {
  const std::string dir = testing::temp_dir();
  const std::string target = dir + "/t.gguf", drafter = dir + "/d.gguf";
  const std::vector<std::string> width = {"--n-embd",    "256", "--n-head",  "4",
                                          "--n-head-kv", "2",   "--n-ff",    "512",
                                          "--n-vocab",   "600", "--threads", "2"};
  std::vector<std::string> mt = {"mkmodel", "-o", target, "--n-layer", "4"};
  mt.insert(mt.end(), width.begin(), width.end());
  ASSERT_EQ(run_kiln(mt).rc, 0);
  std::vector<std::string> md = {"mkmodel",   "-o",     drafter,        "--arch", "dflash",
                                 "--n-layer", "2",      "--block-size", "5",      "--target-layers",
                                 "1,3",       "--type", "q8_0"};
  md.insert(md.end(), width.begin(), width.end());
  Proc m = run_kiln(md);
  ASSERT_EQ(m.rc, 0) << m.err;
  auto g = GgufFile::open(drafter);
  ASSERT_TRUE(g) << g.error();
  EXPECT_EQ(g->find_tensor("token_embd.weight"), nullptr);
  EXPECT_EQ(g->find_tensor("output.weight"), nullptr);
  EXPECT_FALSE(g->has("tokenizer.ggml.tokens"));
  auto fc = g->find_tensor("fc.weight");
  ASSERT_NE(fc, nullptr);
  EXPECT_EQ(fc->ne[0], 2 * 256);  // two target layers' features, concatenated
  EXPECT_NE(g->find_tensor("blk.1.attn_k_norm.weight"), nullptr);
  const std::vector<std::string> base = {"run", "-m", target,   "-p", "hello world",
                                         "-n",  "12", "--temp", "0",  "--stats"};
  Proc r = run_kiln(base);
  ASSERT_EQ(r.rc, 0) << r.err;
  std::vector<std::string> spec = base;
  spec.insert(spec.end(), {"--dflash", drafter, "--draft-n", "4"});
  Proc d = run_kiln(spec);
  ASSERT_EQ(d.rc, 0) << d.err;
  EXPECT_EQ(d.out, r.out);
  EXPECT_NE(d.err.find("speculative (dflash, k=4)"), std::string::npos) << d.err;
  expect_clean_error(run_kiln({"mkmodel", "-o", dir + "/x.gguf", "--arch", "dflash"}),
                     "--target-layers");
  expect_clean_error(run_kiln({"mkmodel", "-o", dir + "/x.gguf", "--target-layers", "1"}),
                     "--arch dflash");
  // A target layer beyond the target's 4 is refused when the pair meets, with one line.
  std::vector<std::string> far = md;
  far[2] = dir + "/far.gguf";
  far[10] = "1,9";
  ASSERT_EQ(run_kiln(far).rc, 0);
  spec[spec.size() - 3] = dir + "/far.gguf";
  expect_clean_error(run_kiln(spec), "target_layers");
  std::filesystem::remove_all(dir);
}

// The glm-dsa shape (deepseek2's plus a lightning indexer on every layer) loads and runs with
// a top_k below the prompt's length, so the later tokens attend over the indexer's choice; its
// cache holds the latent rows and the indexer keys (idx_head_dim f16 values per token and
// layer).
TEST(KilnMkmodel, GlmDsaLoadsRunsAndCachesIndexerKeys) {
  const std::string dir = testing::temp_dir();
  const std::string out = dir + "/dsa.gguf";
  Proc m = run_kiln(
      {"mkmodel", "-o",          out,   "--type",          "f16", "--threads",   "2",   "--arch",
       "glm-dsa", "--n-embd",    "256", "--n-layer",       "3",   "--n-ff",      "512", "--n-head",
       "4",       "--head-dim",  "48",  "--n-rot",         "16",  "--kv-lora",   "64",  "--q-lora",
       "96",      "--n-expert",  "8",   "--n-expert-used", "2",   "--n-ff-exp",  "128", "--n-vocab",
       "600",     "--idx-heads", "4",   "--idx-head-dim",  "32",  "--idx-top-k", "4"});
  ASSERT_EQ(m.rc, 0) << m.err;
  auto g = GgufFile::open(out);
  ASSERT_TRUE(g) << g.error();
  EXPECT_NE(g->find_tensor("blk.2.indexer.attn_q_b.weight"), nullptr);
  EXPECT_NE(g->find_tensor("blk.0.indexer.k_norm.bias"), nullptr);
  Proc r = run_kiln({"run", "-m", out, "-p", "hello world, once upon a time", "-n", "6", "--temp",
                     "0", "--stats"});
  ASSERT_EQ(r.rc, 0) << r.err;
  // 3 layers x ((64 + 16) latent + 32 indexer) values x 2 bytes, no V plane.
  EXPECT_NE(r.err.find("(672 bytes per token)"), std::string::npos) << r.err;
  // kiln bench adds the dense rows (the same file, selection off) and the KV bytes one token's
  // attention reads, at n_kv = depth + n / 2 = 26 keys: sparse, per layer top_k = 4 latent rows
  // of 160 bytes and all 26 indexer keys of 64; dense, all 26 latent rows.
  // --depth-fill random writes the 24 rows straight into both caches instead of evaluating
  // them: the same tests at the same depth.
  for (const char* fill : {"eval", "random"}) {
    SCOPED_TRACE(fill);
    Proc b = run_kiln({"bench", "-m", out, "-p", "0", "-n", "4", "-d", "24", "-r", "1", "-o",
                       "json", "--threads", "2", "--depth-fill", fill});
    ASSERT_EQ(b.rc, 0) << b.err;
    auto j = nlohmann::json::parse(b.out);
    ASSERT_EQ(j.size(), 2u) << b.out;
    EXPECT_EQ(j[0]["test"], "tg4 @ d24");
    EXPECT_EQ(j[1]["test"], "tg4 dense @ d24");
    EXPECT_GT(j[0]["avg_ts"].get<double>(), 0);
    EXPECT_DOUBLE_EQ(j[0]["attention_kv_bytes_per_token"].get<double>(), 3 * (4 * 160 + 26 * 64));
    EXPECT_DOUBLE_EQ(j[1]["attention_kv_bytes_per_token"].get<double>(), 3 * 26 * 160);
  }
  expect_clean_error(run_kiln({"bench", "-m", out, "-n", "4", "--depth-fill", "zeros"}),
                     "--depth-fill");
  expect_clean_error(run_kiln({"mkmodel", "-o", dir + "/x.gguf", "--arch", "glm-dsa"}), "--q-lora");
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kiln
