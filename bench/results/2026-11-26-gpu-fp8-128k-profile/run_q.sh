#!/bin/bash
# Where a 256-token prefill's host time goes (the Llama-8B shape, 32 layers), bf16 and linear,kv: device
# kernels, idle gaps and the ops with the most self CPU time (bench/profile_prefill.py --host). On an H200
# first the 128K check.
LOG=run_q.log; source bench/gpu_env.sh
N=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$N" | tee -a "$LOG"
if [[ "$N" == *H200* ]]; then bash bench/results/2026-11-26-gpu-fp8-128k-profile/run_e.sh; fi
for f in none linear,kv; do
  A=""; [[ $f != none ]] && A="--fp8 $f"
  T=150 step python3 bench/profile_prefill.py --layers 32 --prompt-len 256 --repeats 5 --gaps 5 --host 40 $A --out "$OUT/prof256_${f//,/_}.json"
done
