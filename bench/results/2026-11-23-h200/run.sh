#!/usr/bin/env bash
# Ran as bench/run_gpu4.sh as of commit 4800ea2, before the benchmark programs became `launch/bench.py`
# subcommands: launch/bench_kernels.py is now `launch/bench.py kernels`, launch/bench_sparse.py `launch/bench.py sparse`.
# One H200: first GPU runs of the Triton flash / split-KV decode kernels and the MInference kernel,
# and an end-to-end dense prefill to check the new dispatcher against the earlier numbers.
LOG=run4.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv | tee -a "$LOG"
T=90 step python3 launch/gpu_check.py
T=170 step python3 launch/bench_kernels.py --quick --out "$OUT/kernels_quick.json"
T=110 step python3 launch/bench.py prefill $L8B --cp-strategy dense --lengths 32768 --repeats 2 --decode-steps 32 --out "$OUT/dense_1gpu.json"
T=180 step python3 launch/bench_sparse.py --lengths 32768,131072 --repeats 3 --out "$OUT/sparse.json"
grep -h '"ok": false' "$LOG" | head -20
