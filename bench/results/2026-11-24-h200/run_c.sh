#!/usr/bin/env bash
# One H200, 2026-11-24, third call: (1) the context check again, each run in its own process and the
# planner asked under the cap minus 0.25 GiB (cuBLAS workspaces, the decode graph pool: not planned);
# (2) the MoE decode kernel tiles (bench/tune_moe_decode.py: the down kernel now sums a token's experts);
# (3) prefill bf16 vs --fp8 linear,kv at 8K and 128K with the 14336-wide silu-mul quantization in one tile.
LOG=run_c.log; source bench/gpu_env.sh
T=300 step python3 bench/context_capacity.py --out "$OUT/capacity.json"
T=150 step python3 bench/tune_moe_decode.py --out "$OUT/tune_moe_decode.json"
P="launch/bench.py prefill $L8B --cp-strategy dense --warmup 0 --repeats 2 --decode-steps 16"
for f in none linear,kv; do
  T=150 step python3 $P --lengths 8192,8192,131072 --fp8 $f --out "$OUT/prefill_c_${f/,/_}.json"
done
grep -h "Traceback\|Error" "$LOG" | head
grep -h "capacity.*fits\|capacity.*memory\|capacity.*planner\|capacity.*done" "$LOG"
