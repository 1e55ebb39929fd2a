// core/config.cpp: parsing and binding of the entries in core/config_entries.h. The one
// place that reads KILN_* environment variables for tunables.
#include "core/config.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>

namespace kiln {

namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

Status parse_into(std::string_view text, bool& out) {
  const std::string t = lower(text);
  if (t == "1" || t == "true" || t == "on" || t == "yes") { out = true; return Status::ok(); }
  if (t == "0" || t == "false" || t == "off" || t == "no") { out = false; return Status::ok(); }
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
  if constexpr (std::is_same_v<T, bool>) return ConfigType::Bool;
  else if constexpr (std::is_same_v<T, int64_t>) return ConfigType::Int;
  else if constexpr (std::is_same_v<T, double>) return ConfigType::Double;
  else {
    static_assert(std::is_same_v<T, std::string>, "config entries are bool/int64_t/double/string");
    return ConfigType::String;
  }
}

#define KILN_CONFIG_ENTRY(type, name, def, help)                                         \
  ConfigEntry{#name, type_of<type>(), help,                                              \
              [](const Config& c) { return to_text(c.name); },                           \
              [](Config& c, std::string_view text) { return parse_into(text, c.name); }},
const ConfigEntry kEntries[] = {
#include "core/config_entries.h"
};
#undef KILN_CONFIG_ENTRY

}  // namespace

std::string_view config_type_name(ConfigType t) {
  switch (t) {
    case ConfigType::Bool: return "bool";
    case ConfigType::Int: return "int";
    case ConfigType::Double: return "number";
    case ConfigType::String: return "string";
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

Expected<Config> load_config(const ConfigOverrides& cli, const EnvLookup& env) {
  Config c;
  for (const ConfigEntry& e : kEntries) {
    const std::string var = e.env_name();
    const char* v = env ? env(var.c_str()) : nullptr;
    if (v == nullptr) continue;
    if (Status s = e.set(c, v); !s) return s.context(var);
  }
  for (const auto& [name, text] : cli) {
    const ConfigEntry* e = find_config_entry(name);
    if (!e) return Status::errorf("unknown option '{}'", name);
    if (Status s = e->set(c, text); !s) return s.context(e->cli_flag());
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
