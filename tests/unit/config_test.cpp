// tests/unit/config_test.cpp: the config registry: every entry is well-formed, precedence is
// default < KILN_* variable < CLI option, bad values are one-line errors naming their source,
// Dev entries go only through the --dev / KILN_DEV door, and the CLI binding
// (apps/kiln/config_cli) lists exactly the User entries.
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "apps/kiln/config_cli.h"
#include "core/config.h"

namespace kiln {
namespace {

EnvLookup fake_env(std::map<std::string, std::string> vars) {
  auto shared = std::make_shared<std::map<std::string, std::string>>(std::move(vars));
  return [shared](const char* name) -> const char* {
    auto it = shared->find(name);
    return it == shared->end() ? nullptr : it->second.c_str();
  };
}

TEST(Config, EveryEntryIsWellFormed) {
  std::set<std::string> names;
  ASSERT_FALSE(config_entries().empty());
  for (const ConfigEntry& e : config_entries()) {
    SCOPED_TRACE(std::string(e.name));
    EXPECT_TRUE(names.insert(std::string(e.name)).second) << "declared twice";
    EXPECT_FALSE(e.help.empty());
    for (char c : e.name) EXPECT_TRUE((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_');
    EXPECT_EQ(e.env_name().rfind("KILN_", 0), 0u);
    // The help must not carry figures (they live in docs/BENCHMARKS.md).
    EXPECT_EQ(e.help.find("H200"), std::string::npos);
    EXPECT_EQ(e.cli_flag().rfind("--", 0), 0u);
    EXPECT_EQ(find_config_entry(e.name), &e);
    EXPECT_EQ(find_config_entry(e.cli_flag()), &e);
    // The default's text parses back to itself.
    Config c;
    ASSERT_TRUE(e.set(c, e.default_text()));
    EXPECT_EQ(e.get(c), e.default_text());
  }
  EXPECT_TRUE(validate(Config{})) << "defaults must be valid";
  EXPECT_EQ(find_config_entry("log_level")->env_name(), "KILN_LOG_LEVEL");
  EXPECT_EQ(find_config_entry("log_level")->cli_flag(), "--log-level");
}

TEST(Config, PrecedenceDefaultThenEnvThenCli) {
  auto d = load_config({}, fake_env({}));
  ASSERT_TRUE(d) << d.error();
  EXPECT_EQ(d->threads, Config{}.threads);

  auto e = load_config({}, fake_env({{"KILN_THREADS", "3"}, {"KILN_MLOCK", "on"}}));
  ASSERT_TRUE(e) << e.error();
  EXPECT_EQ(e->threads, 3);
  EXPECT_TRUE(e->mlock);

  auto c = load_config({{"threads", "5"}, {"--mlock", "false"}},
                       fake_env({{"KILN_THREADS", "3"}, {"KILN_MLOCK", "on"}}));
  ASSERT_TRUE(c) << c.error();
  EXPECT_EQ(c->threads, 5);
  EXPECT_FALSE(c->mlock);
  // The last of repeated options wins, as on most command lines.
  auto r = load_config({{"threads", "5"}, {"threads", "7"}}, fake_env({}));
  EXPECT_EQ(r->threads, 7);
}

TEST(Config, BadValuesNameTheirSource) {
  struct Case {
    ConfigOverrides cli;
    std::map<std::string, std::string> env;
    std::vector<std::string> want;
  };
  const Case cases[] = {
      {{}, {{"KILN_THREADS", "four"}}, {"KILN_THREADS", "'four'", "integer"}},
      {{}, {{"KILN_THREADS", "4x"}}, {"KILN_THREADS", "integer"}},
      {{}, {{"KILN_THREADS", "99999999999999999999"}}, {"KILN_THREADS", "integer"}},
      {{}, {{"KILN_STATS", "maybe"}}, {"KILN_STATS", "boolean"}},
      {{{"threads", "-2"}}, {}, {"threads is -2"}},
      {{{"log_level", "loud"}}, {}, {"log level 'loud'"}},
      {{{"threads", ""}}, {}, {"--threads", "integer"}},
      {{{"no_such_option", "1"}}, {}, {"unknown option 'no_such_option'"}},
  };
  for (const Case& c : cases) {
    auto r = load_config(c.cli, fake_env(c.env));
    ASSERT_FALSE(r) << c.want[0];
    EXPECT_EQ(r.error().find('\n'), std::string::npos);
    for (const std::string& w : c.want)
      EXPECT_NE(r.error().find(w), std::string::npos) << r.error();
  }
}

TEST(Config, DescribeListsEveryEntry) {
  Config c;
  c.threads = 9;
  const std::string d = describe(c);
  for (const ConfigEntry& e : config_entries())
    EXPECT_NE(d.find(std::string(e.name) + " = "), std::string::npos) << e.name;
  EXPECT_NE(d.find("threads = 9"), std::string::npos);
}

TEST(Config, LogLevels) {
  EXPECT_EQ(*parse_log_level("WARN"), LogLevel::warn);
  EXPECT_EQ(*parse_log_level("off"), LogLevel::off);
  EXPECT_FALSE(parse_log_level("verbose"));
}

TEST(Config, DevEntriesOnlyThroughTheDevDoor) {
  // KILN_DEV sets Dev entries; KILN_<NAME> of a Dev entry is not read.
  auto e = load_config({}, fake_env({{"KILN_DEV", "expert_device_async=false,moe-routing=uniform"},
                                     {"KILN_MOE_ROUTING", "zipf"}}));
  ASSERT_TRUE(e) << e.error();
  EXPECT_FALSE(e->expert_device_async);
  EXPECT_EQ(e->moe_routing, "uniform");
  // The command line's --dev wins over KILN_DEV.
  auto kv = parse_dev_assignment("expert_device_async=true");
  ASSERT_TRUE(kv) << kv.error();
  auto c = load_config({*kv}, fake_env({{"KILN_DEV", "expert_device_async=false"}}));
  ASSERT_TRUE(c) << c.error();
  EXPECT_TRUE(c->expert_device_async);
  // A User entry is not a --dev key, a Dev entry not a plain option, unknown names are named.
  EXPECT_NE(parse_dev_assignment("threads=3").error().find("use --threads"), std::string::npos);
  EXPECT_NE(parse_dev_assignment("nope=1").error().find("unknown name 'nope'"), std::string::npos);
  EXPECT_NE(parse_dev_assignment("moe_routing").error().find("name=value"), std::string::npos);
  auto plain = load_config({{"moe_routing", "uniform"}}, fake_env({}));
  ASSERT_FALSE(plain);
  EXPECT_NE(plain.error().find("--dev moe_routing=VALUE"), std::string::npos) << plain.error();
  auto bad = load_config({}, fake_env({{"KILN_DEV", "expert_device_async=maybe"}}));
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().find("KILN_DEV expert_device_async"), std::string::npos) << bad.error();
  // Kernel switches are the backends' option structs', not the registry's.
  for (const ConfigEntry& entry : config_entries()) {
    EXPECT_NE(std::string(entry.name).rfind("cuda_", 0), 0u) << entry.name;
    EXPECT_NE(std::string(entry.name).rfind("cpu_", 0), 0u) << entry.name;
  }
  // --dev help lists every Dev entry and no User entry.
  const std::string help = dev_help();
  for (const ConfigEntry& entry : config_entries())
    EXPECT_EQ(help.find("  " + std::string(entry.name) + "=") != std::string::npos,
              entry.scope == ConfigScope::Dev)
        << entry.name;
}

TEST(ConfigCli, UserEntriesAreOptionsAndOverrideTheEnvironment) {
  CLI::App app("test");
  auto overrides = app::add_config_options(&app);
  for (const ConfigEntry& e : config_entries()) {
    if (e.scope != ConfigScope::User) {
      EXPECT_EQ(app.get_option_no_throw(e.cli_flag()), nullptr) << e.cli_flag();
      continue;
    }
    const bool on = e.type == ConfigType::Bool && e.default_text() == "true";
    const std::string flag = on ? "--no-" + e.cli_flag().substr(2) : e.cli_flag();
    EXPECT_NE(app.get_option_no_throw(flag), nullptr) << flag;
  }
  const char* argv[] = {
      "test", "-t", "6", "--stats", "--log-level=warn", "--dev", "expert_device_async=false"};
  ASSERT_NO_THROW(app.parse(7, const_cast<char**>(argv)));
  auto c = load_config(*overrides, fake_env({{"KILN_THREADS", "2"}, {"KILN_MLOCK", "1"}}));
  ASSERT_TRUE(c) << c.error();
  EXPECT_EQ(c->threads, 6);
  EXPECT_TRUE(c->mlock);
  EXPECT_TRUE(c->stats);
  EXPECT_FALSE(c->expert_device_async);
  EXPECT_EQ(c->log_level, "warn");
  // Help names the variable and the real default, and never CLI11's "{false}" marker.
  const std::string help = app.help();
  EXPECT_NE(help.find("KILN_THREADS"), std::string::npos);
  EXPECT_NE(help.find("default notice"), std::string::npos);
  EXPECT_EQ(help.find("{false}"), std::string::npos) << help;
  EXPECT_EQ(help.find("NAME=VALUE"), std::string::npos) << help;  // --dev is unlisted
  EXPECT_EQ(help.find("--cuda"), std::string::npos) << help;
}

}  // namespace
}  // namespace kiln
