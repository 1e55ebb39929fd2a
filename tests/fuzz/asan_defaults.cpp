// tests/fuzz/asan_defaults.cpp: ASan defaults linked into every libFuzzer target. ASan keeps
// freed memory in a 256 MiB quarantine by default; a fuzz target frees a few KiB per input, so
// that quarantine cycles hundreds of MiB through the cache and the page tables (page faults and
// memsets were a third of fuzz_http_request's time) and buys nothing: 16 MiB still holds the
// memory of thousands of inputs, far more than a use after free inside one input needs.
// ASAN_OPTIONS from the environment still override this (e.g. to reproduce with the default).
extern "C" const char* __asan_default_options() { return "quarantine_size_mb=16"; }
