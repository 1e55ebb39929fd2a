// apps/kiln/config_cli.cpp: the User entries of the config registry as options of a
// subcommand, and the one developer door (--dev name=value) for the Dev entries.
#include "apps/kiln/config_cli.h"

#include <fmt/format.h>

#include <cstdio>

namespace kiln::app {

namespace {
// Short spellings people know from llama.cpp.
std::string short_flag(std::string_view name) { return name == "threads" ? "-t," : ""; }
}  // namespace

std::shared_ptr<ConfigOverrides> add_config_options(CLI::App* cmd) {
  auto out = std::make_shared<ConfigOverrides>();
  for (const ConfigEntry& e : config_entries()) {
    if (e.scope != ConfigScope::User) continue;
    const std::string name(e.name);
    if (e.type == ConfigType::Bool) {
      // One spelling that changes the default: --name when off by default, --no-name when on.
      const bool on = e.default_text() == "true";
      const std::string flag = on ? "--no-" + e.cli_flag().substr(2) : e.cli_flag();
      cmd->add_flag_function(
          flag, [out, name, on](int64_t) { out->emplace_back(name, on ? "false" : "true"); },
          fmt::format("{} (env {})", e.help, e.env_name()));
    } else {
      const std::string def = e.default_text();
      cmd->add_option(
             short_flag(e.name) + e.cli_flag(),
             [out, name](const CLI::results_t& r) {
               out->emplace_back(name, r.empty() ? std::string() : r.back());
               return true;
             },
             fmt::format("{} (env {}, default {})", e.help, e.env_name(),
                         def.empty() ? "none" : def))
          ->type_name(std::string(config_type_name(e.type)))
          ->expected(1);
    }
  }
  cmd->add_option_function<std::vector<std::string>>(
         "--dev",
         [out](const std::vector<std::string>& args) {
           for (const std::string& a : args) {
             if (a == "help") {
               std::fputs(
                   "kiln --dev NAME=VALUE (or KILN_DEV=\"NAME=VALUE,...\"): developer "
                   "tuning for tests, bisecting and benchmarks\n",
                   stdout);
               std::fputs(dev_help().c_str(), stdout);
               throw CLI::Success();
             }
             auto kv = parse_dev_assignment(a);
             if (!kv) throw CLI::ValidationError(kv.error());
             out->push_back(std::move(*kv));
           }
         },
         "developer tuning NAME=VALUE (--dev help lists them)")
      ->type_name("NAME=VALUE")
      ->group("");  // not listed: a door for developers, documented in the README
  return out;
}

}  // namespace kiln::app
