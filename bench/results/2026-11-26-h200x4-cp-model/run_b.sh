#!/usr/bin/env bash
# The standing cp=4 task, call B (after run_a.sh on the same kind of machine); run from the repo root.
# Star (block = anchor = 32K) and APB (anchor 4K, passing 2K) over cp = 4 at 128K-1M, then ring at 1M (on 80 GB cards it may not fit: ring at 512K peaked at 48 GB),
# each process warmed by a 128K prefill first (that row dropped); 32 CUDA-graph decode steps per length.
LOG=run_b.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$LOG"
W="--warmup 0 --repeats 1 --decode-steps 32"
T=130 step torchrun --nproc-per-node 4 launch/bench.py prefill $L8B --cp 4 --cp-strategy star --block-size 32768 --anchor-size 32768 --lengths 131072,131072,262144,524288,1048576 $W --out "$OUT/star_cp4.json"
T=140 step torchrun --nproc-per-node 4 launch/bench.py prefill $L8B --cp 4 --cp-strategy apb --anchor-size 4096 --passing-size 2048 --lengths 131072,131072,262144,524288,1048576 $W --out "$OUT/apb_cp4.json"
T=200 step torchrun --nproc-per-node 4 launch/bench.py prefill $L8B --cp 4 --cp-strategy ring --lengths 131072,1048576 $W --out "$OUT/ring_cp4_1m.json"
grep -h "Traceback\|Error" "$LOG" | head
grep -h '^{"length"' "$LOG" | cut -c1-400
