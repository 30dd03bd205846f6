#!/bin/bash
# Device call A (one H200, carry .whl and .smol3/part_aa; the GGUF's first third kept in /tmp for call C):
# the "never below 0.95x dense" target on random weights after the sync removal: Llama-3.1-8B shape, 128K,
# random token ids, dense vs --sparse minference (default pattern: dense-like on random weights, so the
# cost model must send every head dense).
LOG=run_a.log; source bench/gpu_env.sh
mkdir -p /tmp/smol && cp .smol3/part_aa /tmp/smol/
P="python3 launch/bench.py prefill $L8B --cp-strategy dense --lengths 131072 --warmup 1 --repeats 2 --decode-steps 0"
T=150 step $P --out $OUT/l8b_dense_128k.json
T=150 step $P --sparse minference --out $OUT/l8b_mi_128k.json
grep -h "Traceback\|Error" "$LOG" | head -5
grep -h '"prefill_seconds"\|heads_' $OUT/*.json
