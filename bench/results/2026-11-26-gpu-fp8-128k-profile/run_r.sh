#!/bin/bash
# Host time per launch of the FP8 prefill's ops vs bf16's at 256 rows (bench/launch_overhead.py): why
# `linear,kv` is slower below ~1K tokens (run_p, run_q). On an H200 first the 128K check.
LOG=run_r.log; source bench/gpu_env.sh
N=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$N" | tee -a "$LOG"
if [[ "$N" == *H200* ]]; then bash bench/results/2026-11-26-gpu-fp8-128k-profile/run_e.sh; fi
T=120 step python3 bench/launch_overhead.py --rows 256 --out "$OUT/launch_overhead.json"
