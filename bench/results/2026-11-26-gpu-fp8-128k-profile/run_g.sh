#!/bin/bash
# The bf16 128K prefill with SwiGLU's silu-mul in one pass (bench/bf16_swiglu_fused.py; a measurement, the
# engine unchanged): how much of `linear,kv`'s 128K gain is that fusion alone. On an H200 first the 128K check.
LOG=run_g.log; source bench/gpu_env.sh
N=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$N" | tee -a "$LOG"
if [[ "$N" == *H200* ]]; then bash bench/results/2026-11-26-gpu-fp8-128k-profile/run_e.sh; fi
T=240 step python3 bench/bf16_swiglu_fused.py --rounds 2 --out "$OUT/bf16_swiglu_fused.json"
