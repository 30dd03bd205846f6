#!/bin/bash
# cuBLAS e4m3 GEMM variants of the MLP / qkv projections at 128K rows (bench/fp8_gemm_splits.py), with SM clock
# and power sampled. On an H200 first the 128K check (run_e).
LOG=run_f.log; source bench/gpu_env.sh
N=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$N" | tee -a "$LOG"
if [[ "$N" == *H200* ]]; then bash bench/results/2026-11-26-gpu-fp8-128k-profile/run_e.sh; fi
T=200 step python3 bench/fp8_gemm_splits.py --out "$OUT/gemm_splits.json"
