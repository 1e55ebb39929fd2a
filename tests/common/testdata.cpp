// tests/common/testdata.cpp: locating ../shared and small file helpers for tests.
#include "common/testdata.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace kiln::testing {
namespace fs = std::filesystem;

[[noreturn]] static void die(const std::string& msg) {
  fmt::print(stderr, "FATAL (test data): {}\n", msg);
  std::fflush(stderr);
  std::abort();
}

const std::string& shared_dir() {
  static const std::string dir = [] {
    std::string d;
    if (const char* e = std::getenv("KILN_SHARED"); e && *e)
      d = e;
    else
      d = std::string(KILN_SOURCE_DIR) + "/../shared";
    std::error_code ec;
    fs::path p = fs::weakly_canonical(d, ec);
    if (ec || !fs::is_directory(p / "testdata"))
      die(
          fmt::format("shared test data not found at '{}' (set KILN_SHARED or place ../shared "
                      "beside the checkout)",
                      d));
    return p.string();
  }();
  return dir;
}

std::string shared_path(const std::string& rel) {
  std::string p = shared_dir() + "/" + rel;
  if (!fs::exists(p)) die(fmt::format("missing shared file '{}'", p));
  return p;
}

std::string model_path(const std::string& file) { return shared_path("testdata/models/" + file); }

std::string source_path(const std::string& rel) {
  std::string p = std::string(KILN_SOURCE_DIR) + "/" + rel;
  if (!fs::exists(p)) die(fmt::format("missing source file '{}'", p));
  return p;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) die(fmt::format("cannot read '{}'", path));
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void write_file(const std::string& path, std::string_view bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!f) die(fmt::format("cannot write '{}'", path));
}

std::string kiln_binary() {
  if (const char* e = std::getenv("KILN_BIN"); e && *e) return e;
  return std::string(KILN_BINARY_DIR_FALLBACK);
}

std::string temp_dir() {
  std::string tmpl = (fs::temp_directory_path() / "kiln-test-XXXXXX").string();
  if (!::mkdtemp(tmpl.data())) die("mkdtemp failed");
  return tmpl;
}

}  // namespace kiln::testing
