#!/usr/bin/env bash
# One H200, 2026-11-24, second call: (1) the context check of issue 19 (bench/context_capacity.py: 4-layer
# Llama-8B shape under a 7 GiB allocator cap, the planner's longest prompt for bf16 and --fp8 linear,kv,
# each run; bf16 at the fp8 length must run out of memory); (2) the Qwen3-30B-A3B-shaped decode step
# (issue 20) after the fused routing and RoPE; (3) per-kernel decode profiles (8B --fp8 linear,kv @8K, MoE @4K).
LOG=run_b.log; source bench/gpu_env.sh
T=240 step python3 bench/context_capacity.py --out "$OUT/capacity.json"
T=240 step python3 launch/bench.py moe --random-weights qwen3-30b-a3b --skip-hf --prefill-lengths 4096 --repeats 1 --decode-contexts 4096,32768 --decode-steps 32 --out "$OUT/moe.json"
T=150 step python3 bench/profile_decode.py $L8B --fp8 linear,kv --prompt-len 8000 --sort cuda_time_total
T=200 step python3 bench/profile_decode.py --random-weights qwen3-30b-a3b --prompt-len 4000 --sort cuda_time_total
grep -h "Traceback\|Error" "$LOG" | head
grep -h "step_seconds\|measured_over_bytes_bound" "$LOG" | cut -c1-300
