#!/bin/bash
# Issue 20: the floor of a decode step built from one kernel per op (bench/decode_floor.py) beside the real
# step (launch/bench.py moe) on the same card; issue 19: a prefill MLP whole vs row chunks (bench/mlp_row_chunks.py).
# On an H200 first issue 19's 128K check (../2026-11-26-gpu-fp8-128k-check/run_a.sh's runs).
LOG=run_a.log; source bench/gpu_env.sh
NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$NAME" | tee -a "$LOG"
case "$NAME" in *H200*) BW=4.8e12 ;; *) BW=3.35e12 ;; esac
if [[ "$NAME" == *H200* ]]; then
  W="--cp-strategy dense --lengths 131072 --warmup 1 --repeats 2 --decode-steps 0"
  T=150 step python3 launch/bench.py prefill $L8B $W --out "$OUT/bf16_1.json"
  T=150 step python3 launch/bench.py prefill $L8B $W --fp8 linear,kv --out "$OUT/fp8_1.json"
  T=150 step python3 launch/bench.py prefill $L8B $W --out "$OUT/bf16_2.json"
fi
for C in 4096 32768; do
  T=120 step python3 bench/decode_floor.py --context $C --hbm-bandwidth $BW --out "$OUT/floor_moe_$C.json"
done
T=120 step python3 bench/decode_floor.py --preset llama-3.1-8b --context 8192 --hbm-bandwidth $BW --out "$OUT/floor_l8b.json"
M="launch/bench.py moe --random-weights qwen3-30b-a3b --skip-hf --prefill-lengths 4096 --repeats 1 --decode-contexts 4096,32768 --decode-steps 32 --hbm-bandwidth $BW"
T=150 step python3 $M --out "$OUT/moe.json"
T=150 step python3 bench/mlp_row_chunks.py --out "$OUT/mlp_row_chunks.json"
grep -h "Traceback\|Error" "$LOG" | head
