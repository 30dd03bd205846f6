#!/usr/bin/env bash
# One H200: decode kernels (issues 19, 20), CUDA-graph timings: the RMSNorm kernel vs torch
# (bench/norm_bench.py), the e4m3 split-KV attention with transposed products (bench/decode_swap_probe.py)
# and the library kernel's tile sweep (bench/fp8_tune.py --parts decode), all at 128K keys for attention.
LOG=run.log; source bench/gpu_env.sh
T=60 step python3 bench/norm_bench.py --out "$OUT/norm.json"
T=150 step python3 bench/decode_swap_probe.py --out "$OUT/swap.json"
T=150 step python3 bench/fp8_tune.py --parts decode --out "$OUT/fp8_decode_tune.json"
grep -h "Traceback\|Error" "$LOG" | head
