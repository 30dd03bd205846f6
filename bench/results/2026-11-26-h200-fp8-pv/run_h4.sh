#!/bin/bash
# Call H4: Llama-3.1-8B shape, random weights, 128K prefill (warm-up 1, one run): --fp8 linear,kv,attention
# on variant s (the library) and on variant t (with_variant_t.py), same machine.
LOG=run_h4.log; source bench/gpu_env.sh
P="launch/bench.py prefill $L8B --cp-strategy dense --lengths 131072 --warmup 1 --repeats 1 --decode-steps 0 --fp8 linear,kv,attention"
T=200 step python3 $P --out $OUT/l8b_128k_attention_s.json
T=200 step python3 bench/results/2026-11-26-h200-fp8-pv/with_variant_t.py $P --out $OUT/l8b_128k_attention_t.json
grep -h "Traceback\|Error\|with_variant_t" "$LOG" | head
grep -h '"prefill_seconds"' $OUT/l8b_128k_*.json | tee -a "$LOG"
