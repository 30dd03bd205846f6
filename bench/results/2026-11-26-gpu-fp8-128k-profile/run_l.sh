#!/bin/bash
# torch._scaled_grouped_mm vs bf16 _grouped_mm by token count, random and equal routing (run_k: the e4m3 expert
# path lost to bf16 at 4K-16K tokens). On an H200 first the Llama-8B 128K check.
LOG=run_l.log; source bench/gpu_env.sh
N=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$N" | tee -a "$LOG"
if [[ "$N" == *H200* ]]; then bash bench/results/2026-11-26-gpu-fp8-128k-profile/run_e.sh; fi
T=200 step python3 bench/scaled_grouped_mm_probe.py --tokens 1024,2048,4096,8192,16384,32768,65536 --out "$OUT/scaled_grouped_mm_probe.json"
