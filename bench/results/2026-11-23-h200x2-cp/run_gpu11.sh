#!/usr/bin/env bash
# Ran as bench/run_gpu11.sh with the code at commit 85526d0; run it from the repo root (it sources bench/gpu_env.sh).
# 2 x H200: the long points run_gpu9.sh had no time for: Star (block = anchor = 32K) at 1M and ring at
# 512K, each process warmed by a 128K prefill first (its row dropped by bench/cp_summary.py).
LOG=run11.log; source bench/gpu_env.sh
W="--warmup 0 --repeats 1 --decode-steps 16"
T=200 step torchrun --nproc-per-node 2 launch/bench.py prefill $L8B --cp 2 --cp-strategy star --block-size 32768 --anchor-size 32768 --lengths 131072,1048576 $W --out "$OUT/star_cp2_1m.json"
T=200 step torchrun --nproc-per-node 2 launch/bench.py prefill $L8B --cp 2 --cp-strategy ring --lengths 131072,524288 $W --out "$OUT/ring_cp2_512k.json"
grep -h "Traceback\|Error" "$LOG" | head
