// tests/template/jinja_snippets_test.cpp: interpreter features one at a time, each compared
// with what Jinja2 itself rendered (jinja_snippets.json, made by make_jinja_snippets.py):
// literals and printing, whitespace control, loops, macros, filters, tests, methods, errors.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <span>
#include <utility>
#include <vector>

#include "common/testdata.h"
#include "tokenizer/jinja/chat_template.h"

namespace kiln {
namespace {

using ojson = nlohmann::ordered_json;

TEST(JinjaSnippets, MatchJinja2) {
  ojson doc = ojson::parse(
      testing::read_file(std::string(KILN_TEMPLATE_TEST_DIR) + "/jinja_snippets.json"));
  ChatTemplateOptions opt;
  opt.now = doc["now"].get<std::string>();
  int passed = 0, total = 0;
  for (const ojson& sn : doc["snippets"]) {
    ++total;
    const std::string src = sn["template"].get<std::string>();
    auto out = render_chat_template(src, doc["context"], opt);
    if (sn.contains("output")) {
      if (!out) {
        ADD_FAILURE() << "template: " << src << "\nfailed: " << out.error();
        continue;
      }
      EXPECT_EQ(*out, sn["output"].get<std::string>()) << "template: " << src;
      passed += *out == sn["output"].get<std::string>();
    } else {
      const std::string want = sn["error"].get<std::string>();
      if (out) {
        ADD_FAILURE() << "template: " << src << "\nexpected error: " << want
                      << "\nrendered: " << *out;
        continue;
      }
      // Syntax errors must be reported as such; their wording is our own.
      const std::string kind = want.substr(0, want.find(':'));
      if (kind == "TemplateSyntaxError") {
        EXPECT_EQ(out.error().substr(0, kind.size() + 1), kind + ":")
            << "template: " << src << "\ngot: " << out.error();
        passed += out.error().rfind(kind + ":", 0) == 0;
      } else {
        EXPECT_EQ(out.error(), want) << "template: " << src;
        passed += out.error() == want;
      }
    }
  }
  std::printf("jinja snippets: %d/%d match Jinja2\n", passed, total);
}

TEST(JinjaLimits, HostileTemplatesStopWithAnError) {
  const ojson ctx = {{"messages", ojson::array()}};
  ChatTemplateOptions opt;
  opt.max_steps = 200000;
  opt.max_output_bytes = 1 << 20;
  // Unbounded recursion, huge loops, output blow-up and deep nesting all end in errors.
  const char* hostile[] = {
      "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
      "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
      "{% set s = namespace(v='x') %}{% for i in range(100) %}{% set s.v = s.v ~ s.v %}{% endfor "
      "%}",
      "{{ 'x' * 100000000 }}",
      // A recursive loop object kept past its loop must not reach the finished loop's state.
      "{% set ns = namespace() %}{% for x in [1] recursive %}{% set ns.l = loop %}{% endfor %}{{ "
      "ns.l([1]) }}",
  };
  for (const char* src : hostile) {
    auto out = render_chat_template(src, ctx, opt);
    EXPECT_FALSE(out) << src;
  }
  std::string deep(5000, '(');
  EXPECT_FALSE(render_chat_template("{{ " + deep + "1" + std::string(5000, ')') + " }}", ctx));
  std::string chain = "{{ 1";
  for (int i = 0; i < 5000; ++i) chain += " + 1";
  EXPECT_FALSE(render_chat_template(chain + " }}", ctx));
  std::string nested;
  for (int i = 0; i < 1000; ++i) nested += "{% if true %}";
  EXPECT_FALSE(render_chat_template(nested, ctx));
}

// With the default limits (issue 37): a nested loop that would burn seconds stops at the time
// limit, a string that doubles and a list of large strings stop at the memory cap, each with
// one line naming the cap; a template that builds its prompt in a variable over a long
// conversation (output of about the context's size) stays within the cap.
TEST(JinjaLimits, DefaultTimeAndMemoryCaps) {
  const ojson ctx = {{"messages", ojson::array()}};
  auto nested = render_chat_template(
      "{% for a in range(5000) %}{% for b in range(5000) %}{% endfor %}{% endfor %}", ctx);
  ASSERT_FALSE(nested);
  EXPECT_NE(nested.error().find("ms time limit"), std::string::npos) << nested.error();
  for (const char* src : {
           "{% set ns = namespace(v='x') %}{% for i in range(40) %}{% set ns.v = ns.v + ns.v "
           "%}{% endfor %}{{ ns.v | length }}",
           "{% set ns = namespace(l=[]) %}{% for i in range(1000) %}{% set ns.l = ns.l + ['y' * "
           "1000000] %}{% endfor %}{{ ns.l | length }}",
       }) {
    auto out = render_chat_template(src, ctx);
    ASSERT_FALSE(out) << src;
    EXPECT_NE(out.error().find("MemoryError: template used more than"), std::string::npos)
        << out.error();
  }
  // 500 messages of 2 KiB, accumulated in a namespace variable then printed: the memory cap
  // must leave room for it (the quadratic copying takes longer than the default time limit
  // under the sanitizers, which is not what this case is about).
  ChatTemplateOptions kNoTimeLimit;
  kNoTimeLimit.max_time = std::chrono::milliseconds(0);
  ojson msgs = ojson::array();
  for (int i = 0; i < 500; ++i)
    msgs.push_back({{"role", i % 2 ? "assistant" : "user"}, {"content", std::string(2048, 'a')}});
  auto long_chat = render_chat_template(
      "{% set ns = namespace(p='') %}{% for m in messages %}{% set ns.p = ns.p + '<' + m.role + "
      "'>' + m.content %}{% endfor %}{{ ns.p }}",
      ojson{{"messages", msgs}}, kNoTimeLimit);
  ASSERT_TRUE(long_chat) << long_chat.error();
  EXPECT_GT(long_chat->size(), size_t(500 * 2048));
}

// Each template renders (with no messages) to its expected text.
void expect_renders(std::span<const std::pair<const char*, const char*>> cases) {
  const ojson ctx = {{"messages", ojson::array()}};
  for (const auto& [src, want] : cases) {
    auto out = render_chat_template(src, ctx);
    ASSERT_TRUE(out) << src << ": " << out.error();
    EXPECT_EQ(*out, want) << src;
  }
}
// Each template fails with one line that starts with its expected error.
void expect_refused(std::span<const std::pair<const char*, const char*>> cases) {
  const ojson ctx = {{"messages", ojson::array()}};
  for (const auto& [src, want] : cases) {
    auto out = render_chat_template(src, ctx);
    ASSERT_FALSE(out) << src << " rendered " << out->size() << " bytes";
    EXPECT_EQ(out.error().rfind(want, 0), 0u) << src << ": " << out.error();
    EXPECT_EQ(out.error().find('\n'), std::string::npos) << out.error();
  }
}

// Recursion through macros multiplies the parser's nesting caps: each of up to max_call_depth
// macro levels can evaluate an expression nested over a hundred deep. fuzz_template found such a
// template overflowing the stack (under ASan, whose frames are ~20x larger). Every statement and
// expression checks the render's stack budget (RenderLimits::max_stack_bytes), so this ends in
// one RecursionError line, whatever the build's frame sizes; a shallow one still renders.
TEST(JinjaLimits, DeepRecursionIsARecursionErrorNotAStackOverflow) {
  std::string minus;
  for (int k = 0; k < 150; ++k) minus += "- ";
  const std::string deep = "{%- macro f(n) -%}{%- if n > 0 -%}{{ " + minus +
                           "f(n - 1) }}{%- else -%}0{%- endif -%}{%- endmacro -%}{{ f(190) }}";
  const std::string shallow =
      "{%- macro f(n) -%}{%- if n > 0 -%}{{ - - (f(n - 1)|int) }}"
      "{%- else -%}7{%- endif -%}{%- endmacro -%}{{ f(20) }}";
  const std::pair<const char*, const char*> refused[] = {
      {deep.c_str(), "RecursionError: maximum recursion depth exceeded (the render's"}};
  expect_refused(refused);
  const std::pair<const char*, const char*> fine[] = {{shallow.c_str(), "7"}};
  expect_renders(fine);
}

// Values nest as deep as the memory cap lets a template build them (a list wrapped in a list in
// a loop); printing a 30,000-deep one crashed the renderer (stack overflow in the repr). The
// recursive walks over values (repr, comparison; tojson had its own bound) stop at 512 levels
// with one RecursionError line, as Python's recursion limit does.
TEST(JinjaLimits, DeeplyNestedValuesAreARecursionErrorNotAStackOverflow) {
  const std::string build =
      "{%- set ns = namespace(x=[], y=[]) -%}{%- for i in range(30000) -%}"
      "{%- set ns.x = [ns.x] -%}{%- set ns.y = [ns.y] -%}{%- endfor -%}";
  const std::string print = build + "{{ ns.x }}", compare = build + "{{ ns.x == ns.y }}",
                    order = build + "{{ [ns.x, ns.y]|sort|length }}";
  const std::pair<const char*, const char*> refused[] = {
      {print.c_str(),
       "RecursionError: maximum recursion depth exceeded while getting the repr of an object"},
      {compare.c_str(), "RecursionError: maximum recursion depth exceeded in comparison"},
      {order.c_str(), "RecursionError: maximum recursion depth exceeded in comparison"}};
  expect_refused(refused);
  const std::pair<const char*, const char*> fine[] = {
      {"{%- set ns = namespace(x=[]) -%}{%- for i in range(3) -%}{%- set ns.x = [ns.x] -%}"
       "{%- endfor -%}{{ ns.x }} {{ ns.x == [[[[]]]] }}",
       "[[[[]]]] True"}};
  expect_renders(fine);
}

// Integer powers take steps in the exponent's bits, not its value (fuzz_template found
// `1 ** 4122244444` spinning past its 10 s timeout: the time cap is checked between
// statements, not inside one operator), and a power past int64 is refused, not wrapped.
TEST(JinjaLimits, IntegerPowersAreBoundedAndExact) {
  const std::pair<const char*, const char*> cases[] = {
      {"{{ 1 ** 9223372036854775807 }}", "1"},      {"{{ (-1) ** 9223372036854775807 }}", "-1"},
      {"{{ 0 ** 9223372036854775807 }}", "0"},      {"{{ 7 ** 0 }}", "1"},
      {"{{ 2 ** 62 }}", "4611686018427387904"},     {"{{ 3 ** 39 }}", "4052555153018976267"},
      {"{{ (-2) ** 63 }}", "-9223372036854775808"}, {"{{ (-3) ** 3 }}", "-27"},
  };
  expect_renders(cases);
  constexpr const char* kTooLarge = "OverflowError: integer power too large";
  const std::pair<const char*, const char*> refused[] = {{"{{ 2 ** 63 }}", kTooLarge},
                                                         {"{{ 3 ** 40 }}", kTooLarge},
                                                         {"{{ 4444222444444 ** 1222 }}", kTooLarge},
                                                         {"{{ (-2) ** 64 }}", kTooLarge}};
  expect_refused(refused);
}

// Integer results past int64 fail with OverflowError (Python's ints are unbounded; wrapping
// would be undefined behaviour, which fuzz_template's UBSan reported for `*` and `**`), and the
// operators next to them keep Python's values at the edges.
TEST(JinjaLimits, IntegerArithmeticStaysWithinInt64) {
  const std::pair<const char*, const char*> cases[] = {
      {"{{ 9223372036854775806 + 1 }}", "9223372036854775807"},
      {"{{ -9223372036854775807 - 1 }}", "-9223372036854775808"},
      {"{{ (-9223372036854775807 - 1) // 2 }}", "-4611686018427387904"},
      {"{{ -7 // 2 }} {{ 7 // -2 }} {{ -7 % 3 }} {{ 7 % -3 }} {{ 5 % -1 }}", "-4 -4 2 -2 0"},
      {"{{ (-9223372036854775807 - 1) % -1 }}", "0"},
      {"{{ (-9223372036854775807 - 1) % 9223372036854775807 }}", "9223372036854775806"},
      {"{{ '' * 1000000000000000000 }}|{{ ([] * 1000000000000000000) | length }}", "|0"},
      {"{{ range(9223372036854775800, 9223372036854775807, 4) | list }}",
       "[9223372036854775800, 9223372036854775804]"},
      {"{{ [1, 2] | sum }} {{ (-5) | abs }}", "3 5"},
      {"{{ 2.5 is even }} {{ 2.5 is odd }} {{ 3.0 is odd }} {{ -3 is odd }} {{ -4 is even }}",
       "False False True True True"},
      {"{{ 'nan' | float | int }} {{ -2.9 | int }} {{ '%d' % 7.9 }} {{ 1e300 is even }}",
       "0 -2 7 True"},
      {"{{ 'abcdefg'[5::9223372036854775807] }}{{ 'abcdefg'[1::-9223372036854775807 - 1] }}", "fb"},
  };
  expect_renders(cases);
  std::vector<std::pair<const char*, const char*>> refused;
  for (const char* src :
       {"{{ 9223372036854775807 + 1 }}", "{{ -9223372036854775807 - 2 }}",
        "{{ 38862602496 * 44444444343 }}", "{{ -(-9223372036854775807 - 1) }}",
        "{{ (-9223372036854775807 - 1) // -1 }}", "{{ [9223372036854775807, 1] | sum }}",
        "{{ (-9223372036854775807 - 1) | abs }}", "{{ 1e300 | int }}", "{{ '1e19' | int }}",
        "{{ '%d' % 1e300 }}"})
    refused.emplace_back(src, "OverflowError: integer result too large");
  expect_refused(refused);
}

// Field widths, precisions and paddings past kMaxFormatWidth are refused before anything is
// allocated (fuzz_template found '{:0000...9#}'.format() asking for 2^49 bytes), each with one
// line naming what was too large; ordinary widths keep Python's output.
TEST(JinjaLimits, HugeFormatWidthsAreRefused) {
  const std::pair<const char*, const char*> huge[] = {
      {"{{ '{:99999999999999999999999}'.format(1) }}", "ValueError: format width"},
      {"{{ '{:.99999999999999999999}'.format(1.5) }}", "ValueError: format precision"},
      {"{{ '%99999999999d' % 5 }}", "ValueError: format width"},
      {"{{ 'a'.center(99999999999) }}", "ValueError: format width"},
      {"{{ 'a'.ljust(2000000) }}", "ValueError: format width"},
      {"{{ '5'.zfill(99999999999) }}", "ValueError: zfill width"},
      {"{{ 'a' | indent(99999999999) }}", "ValueError: indent width"},
      {"{{ 'a' | center(99999999999) }}", "ValueError: format width"},
  };
  expect_refused(huge);
  const std::pair<const char*, const char*> fine[] = {
      {"{{ '{:>5}'.format('ab') }}|{{ '7'.zfill(3) }}|{{ 'ab'.center(6, '*') }}",
       "   ab|007|**ab**"},
      {"{{ '%5.2f' % 3.14159 }}|{{ '{:08.3f}'.format(-2.5) }}", " 3.14|-002.500"},
  };
  expect_renders(fine);
}

TEST(JinjaApi, ParseOnceRenderMany) {
  auto t = ChatTemplate::parse(
      "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}{{ extra }}");
  ASSERT_TRUE(t) << t.error();
  for (int n = 0; n < 3; ++n) {
    ojson ctx;
    ctx["messages"] = ojson::array();
    std::string want;
    for (int k = 0; k < n; ++k) {
      ctx["messages"].push_back({{"role", "user"}, {"content", std::to_string(k)}});
      want += "[user:" + std::to_string(k) + "]";
    }
    auto out = t->render(ctx);
    ASSERT_TRUE(out) << out.error();
    EXPECT_EQ(*out, want);
  }
  EXPECT_FALSE(ChatTemplate::parse("{% if x %}"));
  EXPECT_FALSE(render_chat_template("{{ x }}", ojson::array()));  // context must be an object
  ChatTemplateOptions bad;
  bad.now = "yesterday";
  EXPECT_FALSE(render_chat_template("x", ojson::object(), bad));
}

}  // namespace
}  // namespace kiln
