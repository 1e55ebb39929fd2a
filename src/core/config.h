// core/config.h: the typed config registry. Every tunable is declared once in
// core/config_entries.h; this file turns that list into a struct with one typed field per
// entry and a table apps enumerate to bind CLI options. Precedence: default < environment
// (KILN_<NAME> for User entries, KILN_DEV for Dev entries) < command line (--name, --dev
// name=value). Environment access happens only here.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/log.h"
#include "core/status.h"

namespace kiln {

struct Config {
#define KILN_CONFIG_ENTRY(scope, type, name, def, help) type name = def;
#include "core/config_entries.h"
#undef KILN_CONFIG_ENTRY
};

enum class ConfigType { Bool, Int, Double, String };
// User: an option of the inference subcommands and a KILN_<NAME> variable. Dev: only through
// `--dev name=value` / KILN_DEV (tests, bisecting, benchmarks), never listed by --help.
enum class ConfigScope { User, Dev };
std::string_view config_type_name(ConfigType t);

struct ConfigEntry {
  std::string_view name;  // field name, e.g. "log_level"
  ConfigType type;
  ConfigScope scope;
  std::string_view help;
  std::string (*get)(const Config&);              // current value as text
  Status (*set)(Config&, std::string_view text);  // parse + store; error names the value

  std::string cli_flag() const;  // "--log-level"
  std::string env_name() const;  // "KILN_LOG_LEVEL" (Dev entries: set through KILN_DEV)
  std::string default_text() const { return get(Config{}); }
};

// Every entry, in declaration order.
std::span<const ConfigEntry> config_entries();
const ConfigEntry* find_config_entry(std::string_view name);  // by name or "--flag" spelling

// Returns the value of an environment variable or nullptr; tests pass a fake.
using EnvLookup = std::function<const char*(const char* name)>;
const char* process_env(const char* name);

// (entry name, text) pairs from the command line, in the order given. A name given through the
// developer door is prefixed "dev:" ("dev:cuda_graphs"): only Dev entries take it.
using ConfigOverrides = std::vector<std::pair<std::string, std::string>>;
inline constexpr std::string_view kDevPrefix = "dev:";
// Splits one `--dev` argument "name=value" (name spelled with '_' or '-') into the override
// ("dev:name", value); errors name the argument and list nothing (see dev_help()).
Expected<std::pair<std::string, std::string>> parse_dev_assignment(std::string_view arg);
// The Dev entries, one "name=default  help" line each, for `--dev help`.
std::string dev_help();

// Defaults, then KILN_* variables (KILN_DEV: comma-separated name=value pairs), then `cli`;
// then range checks. Errors are one line naming the source ("KILN_THREADS='x': expected an
// integer").
Expected<Config> load_config(const ConfigOverrides& cli = {}, const EnvLookup& env = process_env);
// Range checks that a single value cannot express (threads >= 0, known log level).
Status validate(const Config& c);
// "name = value" lines, for --stats output and bug reports.
std::string describe(const Config& c);
Expected<LogLevel> parse_log_level(std::string_view text);

}  // namespace kiln
