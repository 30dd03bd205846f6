#!/bin/bash
# Call A: where the decode step's small launches stand on this card. 1) bench/decode_splits.py: the split-KV
# decode's built-in split count vs forced ones (MoE and Llama-8B shapes, 4K-128K); 2) the Qwen3-30B-A3B decode
# step profiled kernel by kernel (4K context, CUDA graph); 3) launch/bench.py moe decode at 4K / 32K (the
# session's baseline on this card). Random weights: fine for decode speed.
LOG=run_a.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
T=240 step python3 bench/decode_splits.py --out "$OUT/decode_splits_a.json"
T=150 step python3 bench/profile_decode.py --random-weights qwen3-30b-a3b --prompt-len 4000 --sort cuda_time_total
M="launch/bench.py moe --random-weights qwen3-30b-a3b --skip-hf --prefill-lengths 4096 --repeats 1 --decode-contexts 4096,32768 --decode-steps 32"
T=200 step python3 $M --out "$OUT/moe_a.json"
grep -h "Traceback\|Error" "$LOG" | head
grep -h '"decode_ms"\|measured_over' "$OUT"/moe_a.json | head
