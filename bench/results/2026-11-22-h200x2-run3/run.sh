#!/usr/bin/env bash
# Ran as bench/run_gpu3.sh with the code at commit 3c424b5; run it from the repo root (it sources bench/gpu_env.sh).
# Third 2 x H200 call: decode after routing short query blocks to the flash kernel.
LOG=run3.log; source bench/gpu_env.sh
T=100 step python3 launch/gpu_check.py
T=200 step python3 launch/bench.py prefill $L8B --cp-strategy dense --lengths 8192,131072 --repeats 2 --decode-steps 64 --out "$OUT/decode_dense_1gpu.json"
T=150 step torchrun --nproc-per-node 2 launch/bench.py prefill $L8B --cp 2 --cp-strategy ring --lengths 131072 --repeats 2 --decode-steps 64 --out "$OUT/decode_ring_cp2.json"
grep -h '"ok": false' "$LOG" | head -20
grep -h '"decode"' "$LOG" | cut -c1-400
