#!/usr/bin/env bash
# One H200, 2026-11-24, eighth call (tree 096e43d): (1) chunked prefill (8192 tokens per forward) of a
# 128K prompt, bf16 vs --fp8 linear,kv (the FP8 chunks read the held e4m3 prefix in the Triton flash
# kernel, bf16 chunks attend the cache through cuDNN): launch/infer.py --json, prefill_seconds;
# (2) per-kernel profiles of the decode step: 8B --fp8 linear,kv at 128K context, Qwen3-MoE at 4K.
LOG=run_h.log; source bench/gpu_env.sh
for f in none linear,kv; do
  T=120 step python3 launch/infer.py $L8B --prompt-len 131072 --prefill-chunk 8192 --max-new-tokens 4 --dtype bfloat16 --fp8 $f --json
done
T=150 step python3 bench/profile_decode.py $L8B --fp8 linear,kv --prompt-len 131000 --sort cuda_time_total
T=150 step python3 bench/profile_decode.py --random-weights qwen3-30b-a3b --prompt-len 4000 --sort cuda_time_total
grep -h "Traceback\|Error" "$LOG" | head
grep -h "prefill_seconds\|decode step" "$LOG" | cut -c1-400
