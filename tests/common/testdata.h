// tests/common/testdata.h: where the shared test data lives. Tests that need it call
// shared_dir(); if ../shared is missing the test fails loudly (never passes empty).
#pragma once

#include <string>
#include <string_view>

namespace kiln::testing {

// Absolute path of the shared folder (KILN_SHARED, else <source>/../shared). Aborts the
// test run with a message if it does not exist.
const std::string& shared_dir();
std::string shared_path(const std::string& rel);  // shared_dir() + "/" + rel, must exist
std::string model_path(const std::string& file);  // testdata/models/<file>
// <kiln checkout>/rel (data kiln keeps itself, e.g. tests/golden/*.json); must exist.
std::string source_path(const std::string& rel);
std::string read_file(const std::string& path);  // whole file; aborts if unreadable
void write_file(const std::string& path, std::string_view bytes);  // aborts if unwritable
// Path of the built `kiln` binary (KILN_BIN, set by ctest).
std::string kiln_binary();
// A fresh empty directory for this test's output files.
std::string temp_dir();

}  // namespace kiln::testing
