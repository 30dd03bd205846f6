#!/usr/bin/env bash
# One H200: where a decode step's device time goes (kernel table per step, CUDA graph replays traced),
# Llama-3.1-8B shape with --fp8 linear,kv and Qwen3-30B-A3B shape in bf16 (random weights); and the
# e4m3 split-KV decode kernel at 128K keys (bench/fp8_tune.py --parts decode).
LOG=run.log; source bench/gpu_env.sh
[ "${SKIP_TUNE:-0}" = 1 ] || T=120 step python3 bench/fp8_tune.py --parts decode --out "$OUT/fp8_decode_tune.json"
T=150 step python3 bench/profile_decode.py $L8B --fp8 linear,kv --prompt-len 8000 --sort cuda_time_total
T=200 step python3 bench/profile_decode.py --random-weights qwen3-30b-a3b --prompt-len 4000 --sort cuda_time_total
grep -h "Traceback\|Error" "$LOG" | head
