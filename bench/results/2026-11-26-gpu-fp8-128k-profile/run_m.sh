#!/bin/bash
# run_l again with fast accumulation and the experts' dequantize timed (the choice for the mid sizes). On an H200 first the Llama-8B 128K check.
LOG=run_m.log; source bench/gpu_env.sh
N=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$N" | tee -a "$LOG"
if [[ "$N" == *H200* ]]; then bash bench/results/2026-11-26-gpu-fp8-128k-profile/run_e.sh; fi
T=200 step python3 bench/scaled_grouped_mm_probe.py --tokens 1024,2048,4096,8192,16384,32768,65536 --out "$OUT/scaled_grouped_mm_probe.json"
