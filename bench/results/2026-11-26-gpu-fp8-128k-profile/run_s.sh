#!/bin/bash
# bf16 prefill at short lengths with silu_mul as torch's two launches vs the one Triton launch (whose host cost is
# 44 us against ~22, run_r): where the kernel should start. On an H200 first the 128K check.
LOG=run_s.log; source bench/gpu_env.sh
N=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$N" | tee -a "$LOG"
if [[ "$N" == *H200* ]]; then bash bench/results/2026-11-26-gpu-fp8-128k-profile/run_e.sh; fi
T=200 step python3 bench/bf16_swiglu_fused.py --kernel-rows --prompt-lens 128 256 512 1024 2048 4096 --rounds 7 --out "$OUT/swiglu_short.json"
