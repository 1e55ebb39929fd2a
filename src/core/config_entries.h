// core/config_entries.h: THE list of kiln's tunables. Each line declares one entry exactly
// once: scope, type (bool, int64_t, double, std::string), name, default, help. The name is the
// field of kiln::Config. A User entry is a command-line option of the inference subcommands
// (--name, '_' written '-') and an environment variable (KILN_NAME): what a person running a
// model would set. A Dev entry is developer tuning for tests, bisecting and benchmarks: set
// only through `--dev name=value` or KILN_DEV="name=value,...", never listed by --help
// (`--dev help` lists them). Nothing else may read KILN_* variables for tunables.
// Intentionally no include guard: included by core/config.h/.cpp with KILN_CONFIG_ENTRY set.

// ---- User: what a person sets
KILN_CONFIG_ENTRY(User, int64_t, threads, 0, "worker threads for CPU kernels; 0 = one per core")
KILN_CONFIG_ENTRY(User, std::string, log_level, "notice",
                  "least severe log level printed: debug, info, notice, warn, error, off")
KILN_CONFIG_ENTRY(User, bool, stats, false, "print counters and timers when the command ends")
KILN_CONFIG_ENTRY(User, bool, mlock, false,
                  "lock the mapped weights in RAM (mlock); falls back with a notice if refused")
KILN_CONFIG_ENTRY(User, std::string, device, "auto",
                  "cuda, cpu, or auto (cuda when this build has it and a GPU is present)")
KILN_CONFIG_ENTRY(User, int64_t, tensor_parallel, 1,
                  "split every layer over this many GPUs joined by NCCL (with --device cpu: "
                  "over CPU backends, a test vehicle)")
KILN_CONFIG_ENTRY(User, int64_t, expert_cache, 0,
                  "MoE: stream experts from the file, keeping at most this many bytes of them "
                  "in RAM (0: off)")
KILN_CONFIG_ENTRY(User, int64_t, expert_cap, 0,
                  "MoE: stream experts from the file, keeping at most this many per layer in "
                  "RAM (0: off)")
KILN_CONFIG_ENTRY(User, int64_t, expert_device_cache, 0,
                  "MoE streaming on CUDA: bytes of expert slices kept on the device (0: half "
                  "of the free device memory)")

// ---- Dev: what a benchmark or a test of a whole run sets (`--dev name=value`). Kernel
// switches are not here: they live in the backends' option structs (CpuOptions, CudaOptions),
// set in code by the tests that pin them, and go once their default is measured.
KILN_CONFIG_ENTRY(Dev, std::string, shared_dir, "",
                  "a folder with testdata/models/stories260K.gguf, where the demo model is looked "
                  "for after the one shipped beside the binary")
KILN_CONFIG_ENTRY(Dev, std::string, expert_device_policy, "lfu",
                  "CUDA expert tier eviction order: lfu (fewest uses, counts halving over "
                  "time) or lru; same outputs")
KILN_CONFIG_ENTRY(Dev, bool, expert_device_async, true,
                  "CUDA expert tier: one op's copies queued back to back and waited for once "
                  "(false: one synchronous copy each); same outputs")
KILN_CONFIG_ENTRY(Dev, bool, expert_prefetch, false,
                  "MoE streaming: while a layer runs, load the experts the next layer used last; "
                  "same outputs (a trial: docs/BENCHMARKS.md has its figures)")
KILN_CONFIG_ENTRY(Dev, std::string, moe_routing, "model",
                  "MoE cache benchmarks: model (the router's top-k), or each token's experts "
                  "drawn by layer, position and token: uniform or zipf[:S] (rank r weighs "
                  "(r+1)^-S, S 1 by default); not the model's outputs unless model")
