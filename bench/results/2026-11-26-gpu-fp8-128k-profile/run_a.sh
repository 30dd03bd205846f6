#!/bin/bash
# Where the non-attention, non-GEMM time of a 128K prefill goes today (issue 19's last target, 128K
# `--fp8 linear,kv` >= 1.15x bf16): Llama-3.1-8B shape with 2 layers, random weights and token ids, one
# profiled prefill each of bf16 and linear,kv (bench/profile_prefill.py). On an H200 first the full check.
LOG=run_a.log; source bench/gpu_env.sh
N=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$N" | tee -a "$LOG"
if [[ "$N" == *H200* ]]; then bash bench/results/2026-11-26-gpu-fp8-128k-check/run_a.sh; fi
T=120 step python3 bench/profile_prefill.py --layers 2 --prompt-len 131072 --repeats 1 --out "$OUT/prof_bf16.json"
T=120 step python3 bench/profile_prefill.py --layers 2 --prompt-len 131072 --repeats 1 --fp8 linear,kv --out "$OUT/prof_fp8.json"
