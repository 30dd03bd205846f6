#!/usr/bin/env bash
# (As run, at commit 9a9fee0, before the benchmark programs became `launch/bench.py` subcommands:
# launch/bench_sparse.py is now `launch/bench.py sparse`.)
# One H200 (device tool, nvidia-h200), bf16, Llama-3.1-8B shape with random weights:
#  1. the runtime-layer refactor re-measured against the committed numbers: dense prefill 8K / 32K,
#     one-GPU decode at 128K (CUDA graph), the Vertical-Slash (1000, 6096) kernel at 128K;
#  2. the service engine (launch/bench.py serve): time to first token uncached vs cached at 32K and
#     128K, aggregate decode tokens/s with 1, 4 and 16 concurrent questions on one cached document.
# Run from the repo root with the megatron-core wheel in .whl (carried): bash bench/results/<this dir>/run.sh
LOG=run.log; source bench/gpu_env.sh
T=150 step python3 launch/bench.py prefill $L8B --cp-strategy dense --lengths 8192,32768 --warmup 1 --repeats 3 --decode-steps 0 --out "$OUT/dense_prefill.json"
T=150 step python3 launch/bench.py prefill $L8B --cp-strategy dense --lengths 131072 --warmup 0 --repeats 1 --decode-steps 32 --out "$OUT/dense_decode_128k.json"
T=120 step python3 launch/bench_sparse.py --lengths 131072 --repeats 3 --out "$OUT/vs_128k.json"
grep -h "Traceback\|Error" "$LOG" | head
# (serve_8b.json / run.log: the first call, before bench.py serve had its warm-up document: its 32K cached
# time includes the Triton compile of the extend kernels. serve_8b_warm.json / run2.log: this line.)
T=420 step python3 launch/bench.py serve $L8B --lengths 32768,131072 --concurrency 1,4,16 --decode-tokens 64 --cache-gib 60 --out "$OUT/serve_8b_warm.json"
# Third call (LOG=run3.log): the service's batched decode steps replaying CUDA graphs (default) vs eager,
# and whether they produce the same tokens (bench/results/<this dir>/compare_graphs.py).
T=300 step python3 launch/bench.py serve $L8B --lengths 32768,131072 --concurrency 1,4,16 --decode-tokens 64 --cache-gib 60 --out "$OUT/serve_8b_graphs.json"
T=300 step python3 launch/bench.py serve $L8B --lengths 32768,131072 --concurrency 1,4,16 --decode-tokens 64 --cache-gib 60 --no-cuda-graphs --out "$OUT/serve_8b_eager.json"
python3 bench/results/2026-11-23-h200-runtime-serve/compare_graphs.py "$OUT/serve_8b_graphs.json" "$OUT/serve_8b_eager.json"
