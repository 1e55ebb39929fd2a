// core/config.cpp: parsing and binding of the entries in core/config_entries.h. The one
// place that reads KILN_* environment variables for tunables.
#include "core/config.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>

#include <fmt/format.h>

namespace kiln {

namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

Status parse_into(std::string_view text, bool& out) {
  const std::string t = lower(text);
  if (t == "1" || t == "true" || t == "on" || t == "yes") {
    out = true;
    return Status::ok();
  }
  if (t == "0" || t == "false" || t == "off" || t == "no") {
    out = false;
    return Status::ok();
  }
  return Status::errorf("'{}': expected a boolean (1/0, true/false, on/off, yes/no)", text);
}

Status parse_into(std::string_view text, int64_t& out) {
  int64_t v = 0;
  auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc() || p != text.data() + text.size())
    return Status::errorf("'{}': expected an integer", text);
  out = v;
  return Status::ok();
}

[[maybe_unused]] Status parse_into(std::string_view text, double& out) {
  // strtod needs a terminated string; from_chars for double is missing in some libstdc++.
  const std::string s(text);
  char* end = nullptr;
  const double v = s.empty() ? 0 : std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size() || !std::isfinite(v))
    return Status::errorf("'{}': expected a finite number", text);
  out = v;
  return Status::ok();
}

Status parse_into(std::string_view text, std::string& out) {
  out = std::string(text);
  return Status::ok();
}

std::string to_text(bool v) { return v ? "true" : "false"; }
std::string to_text(int64_t v) { return std::to_string(v); }
[[maybe_unused]] std::string to_text(double v) { return fmt::format("{}", v); }
std::string to_text(const std::string& v) { return v; }

template <typename T>
constexpr ConfigType type_of() {
  if constexpr (std::is_same_v<T, bool>)
    return ConfigType::Bool;
  else if constexpr (std::is_same_v<T, int64_t>)
    return ConfigType::Int;
  else if constexpr (std::is_same_v<T, double>)
    return ConfigType::Double;
  else {
    static_assert(std::is_same_v<T, std::string>, "config entries are bool/int64_t/double/string");
    return ConfigType::String;
  }
}

#define KILN_CONFIG_ENTRY(scope, type, name, def, help)        \
  ConfigEntry{#name,                                           \
              type_of<type>(),                                 \
              ConfigScope::scope,                              \
              help,                                            \
              [](const Config& c) { return to_text(c.name); }, \
              [](Config& c, std::string_view text) { return parse_into(text, c.name); }},
const ConfigEntry kEntries[] = {
#include "core/config_entries.h"
};
#undef KILN_CONFIG_ENTRY

}  // namespace

std::string_view config_type_name(ConfigType t) {
  switch (t) {
    case ConfigType::Bool:
      return "bool";
    case ConfigType::Int:
      return "int";
    case ConfigType::Double:
      return "number";
    case ConfigType::String:
      return "string";
  }
  return "?";
}

std::string ConfigEntry::cli_flag() const {
  std::string f = "--" + std::string(name);
  for (char& c : f)
    if (c == '_') c = '-';
  return f;
}

std::string ConfigEntry::env_name() const {
  std::string e = "KILN_" + std::string(name);
  for (char& c : e) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return e;
}

std::span<const ConfigEntry> config_entries() { return kEntries; }

const ConfigEntry* find_config_entry(std::string_view name) {
  for (const ConfigEntry& e : kEntries)
    if (e.name == name || e.cli_flag() == name) return &e;
  return nullptr;
}

const char* process_env(const char* name) { return std::getenv(name); }

Expected<LogLevel> parse_log_level(std::string_view text) {
  static constexpr std::pair<std::string_view, LogLevel> kLevels[] = {
      {"debug", LogLevel::debug}, {"info", LogLevel::info},   {"notice", LogLevel::notice},
      {"warn", LogLevel::warn},   {"error", LogLevel::error}, {"off", LogLevel::off}};
  const std::string t = lower(text);
  for (const auto& [n, l] : kLevels)
    if (n == t) return l;
  return Status::errorf("unknown log level '{}' (debug, info, notice, warn, error, off)", text);
}

Status validate(const Config& c) {
  if (c.threads < 0 || c.threads > 4096)
    return Status::errorf("threads is {} (must be 0..4096; 0 = one per core)", c.threads);
  if (auto l = parse_log_level(c.log_level); !l) return Status::error("log_level: " + l.error());
  return Status::ok();
}

Expected<std::pair<std::string, std::string>> parse_dev_assignment(std::string_view arg) {
  const size_t eq = arg.find('=');
  if (eq == std::string_view::npos || eq == 0)
    return Status::errorf("--dev '{}': expected name=value ('--dev help' lists the names)", arg);
  std::string name(arg.substr(0, eq));
  for (char& ch : name)
    if (ch == '-') ch = '_';
  const ConfigEntry* e = find_config_entry(name);
  if (e == nullptr)
    return Status::errorf("--dev '{}': unknown name '{}' ('--dev help' lists them)", arg, name);
  if (e->scope != ConfigScope::Dev)
    return Status::errorf("--dev '{}': '{}' is an option of its own: use {}", arg, name,
                          e->cli_flag());
  return std::pair{std::string(kDevPrefix) + name, std::string(arg.substr(eq + 1))};
}

std::string dev_help() {
  std::string out;
  for (const ConfigEntry& e : kEntries)
    if (e.scope == ConfigScope::Dev)
      out += fmt::format("  {}={}\n      {}\n", e.name, e.default_text(), e.help);
  return out;
}

Expected<Config> load_config(const ConfigOverrides& cli, const EnvLookup& env) {
  Config c;
  for (const ConfigEntry& e : kEntries) {
    if (e.scope != ConfigScope::User) continue;
    const std::string var = e.env_name();
    const char* v = env ? env(var.c_str()) : nullptr;
    if (v == nullptr) continue;
    if (Status s = e.set(c, v); !s) return s.context(var);
  }
  if (const char* dev = env ? env("KILN_DEV") : nullptr) {
    std::string_view rest(dev);
    while (!rest.empty()) {
      const size_t comma = rest.find(',');
      const std::string_view item = rest.substr(0, comma);
      rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
      if (item.empty()) continue;
      auto kv = parse_dev_assignment(item);
      if (!kv) return kv.status().context("KILN_DEV");
      const ConfigEntry* e = find_config_entry(kv->first.substr(kDevPrefix.size()));
      if (Status s = e->set(c, kv->second); !s)
        return s.context("KILN_DEV " + std::string(e->name));
    }
  }
  for (const auto& [given, text] : cli) {
    const bool dev = given.rfind(kDevPrefix, 0) == 0;
    const std::string name = dev ? given.substr(kDevPrefix.size()) : given;
    const ConfigEntry* e = find_config_entry(name);
    if (!e) return Status::errorf("unknown option '{}'", name);
    if (dev != (e->scope == ConfigScope::Dev))
      return dev ? Status::errorf("--dev {}: an option of its own: use {}", name, e->cli_flag())
                 : Status::errorf("'{}' is set only through --dev {}=VALUE", name, e->name);
    const std::string where = dev ? "--dev " + std::string(e->name) : e->cli_flag();
    if (Status s = e->set(c, text); !s) return s.context(where);
  }
  KILN_TRY(validate(c));
  return c;
}

std::string describe(const Config& c) {
  std::string out;
  for (const ConfigEntry& e : kEntries) out += fmt::format("{} = {}\n", e.name, e.get(c));
  return out;
}

}  // namespace kiln
