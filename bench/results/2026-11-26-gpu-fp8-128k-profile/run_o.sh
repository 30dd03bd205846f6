#!/bin/bash
# The final tree's CUDA-graph decode against eager (silu_mul's grid axes swapped, quantize_heads in the FP8
# prefill): Llama-8B shape bf16 and linear,kv at 8K, Qwen3-30B-A3B bf16 and linear,kv,experts at 4K.
# On an H200 first the Llama-8B 128K check.
LOG=run_o.log; source bench/gpu_env.sh
N=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$N" | tee -a "$LOG"
if [[ "$N" == *H200* ]]; then bash bench/results/2026-11-26-gpu-fp8-128k-profile/run_e.sh; fi
T=120 step python3 bench/check_graph_decode.py --random-weights llama-3.1-8b --prompt-len 8192 --steps 32
T=120 step python3 bench/check_graph_decode.py --random-weights llama-3.1-8b --prompt-len 8192 --steps 32 --fp8 linear,kv
T=150 step python3 bench/check_graph_decode.py --random-weights qwen3-30b-a3b --prompt-len 4096 --steps 32
T=150 step python3 bench/check_graph_decode.py --random-weights qwen3-30b-a3b --prompt-len 4096 --steps 32 --fp8 linear,kv,experts
grep -h '^{' "$LOG" > "$OUT/graph_decode.jsonl"
