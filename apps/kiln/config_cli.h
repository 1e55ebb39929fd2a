// apps/kiln/config_cli.h: binds every entry of the config registry (core/config_entries.h) to
// command-line options of a subcommand. CLI11 stays in apps; the registry only lists entries.
#pragma once

#include <CLI/CLI.hpp>
#include <memory>

#include "core/config.h"

namespace kiln::app {

// Adds --<name> (bools: --<name> / --no-<name>) for every config entry to `cmd`, each help
// text naming its KILN_* variable and default. The returned overrides fill in as CLI11
// parses; pass them to load_config() in the subcommand's callback.
std::shared_ptr<ConfigOverrides> add_config_options(CLI::App* cmd);

}  // namespace kiln::app
