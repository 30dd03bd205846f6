#!/usr/bin/env bash
# The standing cp=4 task, 1M on 4 x H200 (the previous x4 machine had 80 GB cards: ring 1M needs 83.0 GiB
# per rank by the planner, APB 81.7 GiB). Run from the repo root, carrying .whl. First the CUDA
# correctness checks (dispatcher, Triton merges, ring / Ulysses over NCCL against float64), then ring,
# APB and Ulysses over cp = 4 at 1M: Llama-3.1-8B shape, random bf16 weights (fine for dense and CP
# speed), each process warmed by a 128K prefill (that row is the cold start; its decode steps are the
# 128K cp = 4 decode after the one-all-gather merge), 32 CUDA-graph decode steps per length.
LOG=run_a.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$LOG"
W="--warmup 0 --repeats 1 --decode-steps 32"
T=90 step torchrun --nproc-per-node 4 launch/gpu_check.py --cp
grep -h '"ok": false' "$LOG" | head
T=230 step torchrun --nproc-per-node 4 launch/bench.py prefill $L8B --cp 4 --cp-strategy ring --lengths 131072,1048576 $W --out "$OUT/ring_cp4_1m.json"
T=100 step torchrun --nproc-per-node 4 launch/bench.py prefill $L8B --cp 4 --cp-strategy apb --anchor-size 4096 --passing-size 2048 --lengths 131072,1048576 $W --out "$OUT/apb_cp4_1m.json"
T=220 step torchrun --nproc-per-node 4 launch/bench.py prefill $L8B --cp 4 --cp-strategy ulysses --lengths 131072,1048576 $W --out "$OUT/ulysses_cp4_1m.json"
grep -h "Traceback\|Error" "$LOG" | head
grep -h '^{"length"' "$LOG" | cut -c1-400
