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
KILN_CONFIG_ENTRY(int64_t, expert_device_cache, 0,
                  "MoE streaming on CUDA: keep at most this many bytes of expert slices on the "
                  "device, evicted in --expert-device-policy order (0: half of the free device "
                  "memory)")
KILN_CONFIG_ENTRY(std::string, expert_device_policy, "lfu",
                  "MoE streaming on CUDA: which expert slice the device tier evicts first: lfu "
                  "(fewest uses, counts halving over time; keeps the popular experts) or lru "
                  "(least recently used); same outputs either way")
KILN_CONFIG_ENTRY(bool, expert_device_async, true,
                  "MoE streaming on CUDA: queue one op's expert copies to the device back to "
                  "back and wait once (off: one synchronous copy each); same outputs either way")
KILN_CONFIG_ENTRY(bool, expert_prefetch, false,
                  "MoE streaming: while a layer runs, load the experts the next layer used last")
KILN_CONFIG_ENTRY(std::string, moe_routing, "model",
                  "MoE benchmarks: model (the router's top-k), or draw each token's experts "
                  "instead, keyed by layer, position and token: uniform (the worst case for "
                  "expert caches) or zipf[:S] (popularity rank r weighs (r+1)^-S, S 1 by default, "
                  "a ranking per layer); not the model's outputs unless model")
KILN_CONFIG_ENTRY(std::string, device, "auto",
                  "backend for run/bench/perplexity: cuda, cpu, or auto (cuda when this build "
                  "has it and a GPU is present, else cpu)")
KILN_CONFIG_ENTRY(int64_t, tensor_parallel, 1,
                  "split every layer's heads and FFN columns (MoE: experts) over this many GPUs "
                  "joined by NCCL; with --device cpu over this many CPU backends (a test "
                  "vehicle: same results, not faster)")
KILN_CONFIG_ENTRY(bool, cpu_q4k_packed, true,
                  "CPU: Q4_K prefill (12+ tokens) through the packed AVX-512 VNNI kernel (same "
                  "bits as the plain kernel, ~1.3x faster than it) where --cpu-kq-batch is off "
                  "(the batched kernels are faster still: docs/BENCHMARKS.md)")
KILN_CONFIG_ENTRY(bool, cpu_kq_pair, true,
                  "CPU: Q4_K/Q6_K matmuls of 4+ tokens (batched decode; Q4_K below 12) through "
                  "the 512-bit AVX-512 VNNI small-batch kernels (same bits as the plain kernels; "
                  "faster by bench/matvec_bench BM_KQPairOnOff, BM_LayerStepKQPair)")
KILN_CONFIG_ENTRY(bool, cpu_kq_batch, true,
                  "CPU (with --cpu-kq-pair): Q4_K/Q6_K matmuls of 2+ tokens, prefill included, "
                  "through the v2 batched AVX-512 VNNI kernels (cheaper block decode, two tokens per 512-bit "
                  "tail, software prefetch; same bits as the plain kernels; faster by "
                  "bench/matvec_bench BM_KQBatchOnOff, BM_LayerStepKQBatch, bench/serve_bench)")
KILN_CONFIG_ENTRY(bool, cpu_kq_prefill, true,
                  "CPU: Q4_K/Q6_K matmuls of 128+ tokens (prefill) through the AVX-512 VNNI prefill "
                  "kernels (token pairs per register, K chunks; same bits as the plain kernels; "
                  "faster by bench/matvec_bench BM_KQPrefillOnOff, kiln bench pp512)")
KILN_CONFIG_ENTRY(bool, cpu_q8k_quant_simd, true,
                  "CPU: encode Q8_K activations (K-quant matmul inputs) with AVX-512 where "
                  "available (same bytes as the scalar loop)")
KILN_CONFIG_ENTRY(bool, cpu_q8_quant_simd, true,
                  "CPU: encode Q8_0 activations (Q8_0/Q4_0/Q5_0 matmul inputs) with AVX-512 where "
                  "available (same bytes as the scalar loop)")
KILN_CONFIG_ENTRY(bool, cpu_float_tile, true,
                  "CPU: F32/F16/BF16 matmuls of 2+ tokens (prefill) through the register-tiled "
                  "kernel (same bits as the one-row kernel; faster by bench/matvec_bench "
                  "BM_FloatTileOnOff and kiln bench pp512)")
KILN_CONFIG_ENTRY(bool, cpu_attn_multi, true,
                  "CPU: attention over heads a whole number of vectors wide through the multi-pair "
                  "kernel (up to 4 (query, head) pairs of one KV head share each K/V row's load; "
                  "same bits as the per-pair kernel; faster by bench/matvec_bench "
                  "BM_AttnMultiOnOff and kiln bench pp512)")
KILN_CONFIG_ENTRY(bool, cpu_kq_one, true,
                  "CPU: single-token (decode) Q4_K/Q6_K matvecs through 512-bit AVX-512 VNNI "
                  "kernels (same bits as the plain kernels; faster by bench/matvec_bench "
                  "BM_KQOneOnOff: the plain ones are multiply-bound below the read bandwidth)")
KILN_CONFIG_ENTRY(bool, cpu_q8_one, true,
                  "CPU without AVX-512: single-token (decode) Q8_0 matvecs through the AVX2 "
                  "two-row kernel (same bits as the plain kernel; faster by bench/matvec_bench "
                  "BM_Q8OneOnOff)")
KILN_CONFIG_ENTRY(bool, cpu_q8_vnni, true,
                  "CPU: Q8_0/Q4_0/Q5_0 matmuls of 8+ tokens (prefill) through the 512-bit "
                  "AVX-512 VNNI kernel (same bits as the plain kernel; faster by "
                  "bench/matvec_bench BM_Q8VnniOnOff, kiln bench pp512)")
KILN_CONFIG_ENTRY(int64_t, cpu_matvec_prefetch, 16384,
                  "CPU: the one-token and v2 batched Q4_K/Q6_K kernels software-prefetch this "
                  "many bytes ahead of their rows (0: off; same results either way)")
KILN_CONFIG_ENTRY(bool, cpu_matvec_prefetch_l2, true,
                  "CPU: those kernels prefetch a span of lines per block step into L2 as they "
                  "read (off: each row group's lines at its start into L1, which stalls on the "
                  "miss buffers; same results either way; docs/BENCHMARKS.md)")
KILN_CONFIG_ENTRY(std::string, cuda_matmul, "auto",
                  "CUDA matmul kernels: v1, v2 (f32 activations; cuBLAS above 16 tokens), v3 (int8 "
                  "activations, dp4a, up to 64 tokens), auto (v3 up to 16 tokens, cuBLAS above)")
KILN_CONFIG_ENTRY(int64_t, cuda_int8_max_tokens, 16,
                  "CUDA (--cuda-matmul auto): quantized matmuls of up to this many tokens run the "
                  "int8 dp4a kernels, more take cuBLAS (1..64)")
KILN_CONFIG_ENTRY(int64_t, cuda_int8_mma, 8,
                  "CUDA: int8 matmuls of at least this many tokens (Q4_K, Q6_K) run on the "
                  "int8 tensor cores (mma.sync) instead of dp4a, with the same bits (0: never)")
KILN_CONFIG_ENTRY(bool, cuda_fuse_rope, true,
                  "CUDA: a layer's Q and K rotary embedding as one launch (angles once per "
                  "token); same outputs")
KILN_CONFIG_ENTRY(bool, cuda_fuse_swiglu, true,
                  "CUDA: SwiGLU computed inside the int8 quantization of the FFN down "
                  "projection's input (one launch fewer per layer); same outputs")
KILN_CONFIG_ENTRY(int64_t, cuda_f16_cache, -1,
                  "CUDA: MiB of f16 weight copies kept for the cuBLAS path (prefill, batches above "
                  "--cuda-int8-max-tokens) instead of dequantizing on every call (0: off; -1, the "
                  "default by measurement: a quarter of the free device memory); same outputs")
KILN_CONFIG_ENTRY(int64_t, cuda_l2_prefetch, 8,
                  "CUDA: MiB of the coming matmuls' K-quant weights each prefetch hint of a "
                  "one-token step pulls into L2 while the small ops before them run (RoPE, KV "
                  "stores, attention, norms); 0: off; same outputs (8 by measurement: 8B Q4_K_M "
                  "tg128 +0.5-3 % on the H200)")
KILN_CONFIG_ENTRY(bool, cuda_profile, false,
                  "CUDA (kiln bench): time one extra pass of each test op by op with CUDA events "
                  "and print the per-kernel table (µs per step, GB/s of the weight reads)")
KILN_CONFIG_ENTRY(bool, cuda_trace, false,
                  "CUDA (kiln bench): one extra pass of each test with CUPTI's kernel records "
                  "(each kernel's own GPU time, inside graphs, PDL as configured): µs per step "
                  "by kernel and the GPU's idle time")
KILN_CONFIG_ENTRY(bool, cuda_pdl, true,
                  "CUDA: programmatic dependent launch: each decode-path kernel starts while the "
                  "one before it drains and prefetches its weights meanwhile; same outputs")
KILN_CONFIG_ENTRY(bool, cuda_mma_pre_scales, true,
                  "CUDA: Q4_K in the int8 tensor-core matmul (8-16 tokens): each stage's scales "
                  "decoded once per block into shared memory, not by every lane; same outputs")
KILN_CONFIG_ENTRY(bool, device_sampling, true,
                  "greedy or plain top-k sampling (no logit bias, penalties or logprobs) takes "
                  "each step's best candidates from the backend (a GPU downloads k values, not "
                  "the vocabulary); same ids. Off: whole logit rows")
KILN_CONFIG_ENTRY(bool, cuda_direct_download, true,
                  "CUDA: logits downloaded by DMA straight into the session's page-locked host "
                  "buffer (off: through the backend's pinned buffer and a host copy); same "
                  "outputs")
KILN_CONFIG_ENTRY(bool, cuda_attn_skip_empty, true,
                  "CUDA: decode attention skips key slices with no visible key (the graph's "
                  "padded key bucket) instead of walking them; same outputs")
KILN_CONFIG_ENTRY(bool, cuda_attn_warp_tiles, true,
                  "CUDA: decode attention by the warp-tile kernel (a warp scores 32 keys at a "
                  "time, one per lane; slices of 256+ keys, no merge kernel for short contexts; "
                  "on by measurement: 8B x64 +33 % on the H200); off: the split kernel (a "
                  "different summation order)")
KILN_CONFIG_ENTRY(bool, cuda_graphs, true,
                  "CUDA: replay each repeated decode step as a CUDA graph (off: launch op by op)")
KILN_CONFIG_ENTRY(bool, cuda_gemm_graphs, true,
                  "CUDA (with --cuda-graphs): steps that use cuBLAS (prefill, batches above "
                  "--cuda-int8-max-tokens) are replayed as graphs too, cuBLAS in a fixed "
                  "workspace (off: op by op; on by measurement: 8B Q4_K_M x32/x64 +8-20 % on the "
                  "H200); same outputs")
