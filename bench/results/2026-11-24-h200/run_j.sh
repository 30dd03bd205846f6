#!/usr/bin/env bash
# One H200, 2026-11-24, tenth call: after run_i.sh's memory check failed (a block's dequantization held two
# float32 temporaries: 816 MB for one 65536-key block of the 8B shape), `dequantize` multiplies in place and
# the planner counts k, v and one float32 temporary per block key. (1) the CUDA tests again; (2) the chunked
# 128K prefill, bf16 vs --fp8 linear,kv; (3) the capacity check with the planner's new count.
LOG=run_j.log; source bench/gpu_env.sh
T=150 step python3 -m pytest -q tests/test_fp8_prefix_attention.py
for f in none linear,kv; do
  T=120 step python3 launch/infer.py $L8B --prompt-len 131072 --prefill-chunk 8192 --max-new-tokens 4 --dtype bfloat16 --fp8 $f --json
done
T=300 step python3 bench/context_capacity.py --out "$OUT/capacity_j.json"
grep -h "Traceback\|Error" "$LOG" | head
grep -h "passed\|failed\|prefill_seconds\|capacity.*planner\|capacity.*fits\|capacity.*memory\|capacity.*done" "$LOG" | cut -c1-300
