#!/bin/bash
# The whole 32-layer Llama-3.1-8B shape at 128K, bf16 and linear,kv, profiled with the idle gaps between
# device kernels listed (run_a's 2-layer fp8 profile: wall 662 ms against 611 ms of kernels).
LOG=run_b.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tee -a "$LOG"
T=200 step python3 bench/profile_prefill.py --layers 32 --prompt-len 131072 --repeats 1 --gaps 15 --fp8 linear,kv --out "$OUT/prof32_fp8.json"
T=200 step python3 bench/profile_prefill.py --layers 32 --prompt-len 131072 --repeats 1 --gaps 15 --out "$OUT/prof32_bf16.json"
