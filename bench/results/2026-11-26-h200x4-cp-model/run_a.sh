#!/usr/bin/env bash
# The standing cp=4 task, second x4 machine (4 x H200 if lent as such), call A; run from the repo root.
# Whole model, Llama-3.1-8B shape, random bf16 weights (fine for dense and CP speed): dense on one GPU
# and the exact strategies over cp = 4 at 128K-512K, with 32 CUDA-graph decode steps per length; one
# attention layer at 32K / 64K against torch's context_parallel (issue 4's short lengths; 128K-1M are in
# ../2026-11-26-h200x4-cp). Each prefill list starts with a 128K run that warms its process (--warmup 0):
# that row is the cold start, the next 128K row is warm (bench/cp_summary.py drops the first row).
LOG=run_a.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$LOG"
W="--warmup 0 --repeats 1 --decode-steps 32"
T=100 step python3 launch/bench.py prefill $L8B --cp-strategy dense --lengths 131072,131072 $W --out "$OUT/dense_1gpu.json"
T=60 step torchrun --nproc-per-node 4 launch/bench.py attention --cp 4 --strategies dense,ring,ulysses,torch-cp --lengths 32768,65536 --repeats 3 --out "$OUT/attention_cp4_short.json"
T=130 step torchrun --nproc-per-node 4 launch/bench.py prefill $L8B --cp 4 --cp-strategy ring --lengths 131072,131072,262144,524288 $W --out "$OUT/ring_cp4.json"
T=120 step torchrun --nproc-per-node 4 launch/bench.py prefill $L8B --cp 4 --cp-strategy ulysses --lengths 131072,131072,262144,524288 $W --out "$OUT/ulysses_cp4.json"
T=80 step torchrun --nproc-per-node 4 launch/bench.py prefill $L8B --cp 4 --cp-strategy usp --ulysses-degree 2 --lengths 131072,131072,262144 $W --out "$OUT/usp_cp4.json"
grep -h "Traceback\|Error" "$LOG" | head
grep -h '^{"length"' "$LOG" | cut -c1-400
