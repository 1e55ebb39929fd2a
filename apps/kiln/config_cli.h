// apps/kiln/config_cli.h: binds the config registry (core/config_entries.h) to command-line
// options of a subcommand. CLI11 stays in apps; the registry only lists entries.
#pragma once

#include <CLI/CLI.hpp>
#include <memory>

#include "core/config.h"

namespace kiln::app {

// Adds --<name> for every User entry to `cmd` (bools: the one spelling that changes the
// default, --<name> or --no-<name>), each help text naming its KILN_* variable and default,
// and the unlisted --dev NAME=VALUE door for the Dev entries (--dev help lists them). The
// returned overrides fill in as CLI11 parses; pass them to load_config() in the callback.
std::shared_ptr<ConfigOverrides> add_config_options(CLI::App* cmd);

}  // namespace kiln::app
