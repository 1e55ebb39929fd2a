// apps/kiln/config_cli.cpp: one CLI option per config entry, generated from the registry.
#include "apps/kiln/config_cli.h"

#include <fmt/format.h>

namespace kiln::app {

std::shared_ptr<ConfigOverrides> add_config_options(CLI::App* cmd) {
  auto out = std::make_shared<ConfigOverrides>();
  for (const ConfigEntry& e : config_entries()) {
    const std::string name(e.name);
    const std::string help =
        fmt::format("{} (env {}, default {})", e.help, e.env_name(), e.default_text());
    if (e.type == ConfigType::Bool) {
      const std::string negated = "--no-" + e.cli_flag().substr(2);
      cmd->add_flag_function(
          e.cli_flag() + ",!" + negated,
          [out, name](int64_t count) { out->emplace_back(name, count > 0 ? "true" : "false"); },
          help);
    } else {
      cmd->add_option(
             e.cli_flag(),
             [out, name](const CLI::results_t& r) {
               out->emplace_back(name, r.empty() ? std::string() : r.back());
               return true;
             },
             help)
          ->type_name(std::string(config_type_name(e.type)))
          ->expected(1);
    }
  }
  return out;
}

}  // namespace kiln::app
