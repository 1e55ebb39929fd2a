// core/config_entries.h: THE list of kiln's tunables. Each line declares one entry exactly
// once: type (bool, int64_t, double, std::string), name, default, help. The name is the
// field of kiln::Config, the CLI option (--name, '_' written '-') and the environment
// variable (KILN_NAME); nothing else may read KILN_* variables for tunables.
// Intentionally no include guard: included by core/config.h/.cpp with KILN_CONFIG_ENTRY set.

KILN_CONFIG_ENTRY(int64_t, threads, 0, "worker threads for CPU kernels; 0 = one per core")
KILN_CONFIG_ENTRY(std::string, log_level, "notice",
                  "least severe log level printed: debug, info, notice, warn, error, off")
KILN_CONFIG_ENTRY(bool, stats, false, "print counters and timers when the command ends")
KILN_CONFIG_ENTRY(bool, mlock, false,
                  "lock mapped weights in RAM (mlock); falls back with a notice if refused")
KILN_CONFIG_ENTRY(std::string, shared_dir, "",
                  "folder with testdata/ (demo model); empty: ../shared beside the checkout")
KILN_CONFIG_ENTRY(int64_t, expert_cache, 0,
                  "MoE: stream experts from the file, keeping at most this many bytes of them "
                  "in RAM (0: off, experts read through the mapping)")
KILN_CONFIG_ENTRY(int64_t, expert_cap, 0,
                  "MoE: stream experts from the file, keeping at most this many per layer in "
                  "RAM (0: off)")
KILN_CONFIG_ENTRY(bool, expert_prefetch, false,
                  "MoE streaming: while a layer runs, load the experts the next layer used last")
KILN_CONFIG_ENTRY(std::string, device, "auto",
                  "backend for run/bench/perplexity: cuda, cpu, or auto (cuda when this build "
                  "has it and a GPU is present, else cpu)")
KILN_CONFIG_ENTRY(int64_t, tensor_parallel, 1,
                  "split every layer's heads and FFN columns (MoE: experts) over this many GPUs "
                  "joined by NCCL; with --device cpu over this many CPU backends (a test "
                  "vehicle: same results, not faster)")
KILN_CONFIG_ENTRY(bool, cpu_q4k_packed, true,
                  "CPU: Q4_K prefill (12+ tokens) through the packed AVX-512 VNNI kernel (same "
                  "bits as the plain kernel, ~1.3x faster: docs/BENCHMARKS.md)")
KILN_CONFIG_ENTRY(std::string, cuda_matmul, "auto",
                  "CUDA matmul kernels: v1, v2, v3 (int8 activations, dp4a), auto (the backend's "
                  "default)")
KILN_CONFIG_ENTRY(bool, cuda_graphs, true,
                  "CUDA: replay each repeated decode step as a CUDA graph (off: launch op by op)")
