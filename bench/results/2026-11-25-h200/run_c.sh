#!/bin/bash
# Device call C (one H200): first half of the SmolLM2 GGUF to /tmp/smol (for call D); the FP8 decode GEMV
# tiles picked from gemv_variants.json (kernels/fp8.py gemv_tile_for): prefill + 64 decode steps at 128K,
# bf16 and --fp8 linear,kv; the whole 32-layer model's 128K prefill under the profiler (kernel time vs wall).
LOG=run_c.log; source bench/gpu_env.sh
mkdir -p /tmp/smol && cp .smol/part_aa /tmp/smol/
P="launch/bench.py prefill $L8B --cp-strategy dense --warmup 1 --repeats 2 --decode-steps 64"
for f in none linear,kv; do
  T=200 step python3 $P --lengths 131072 --fp8 $f --out "$OUT/prefill_c_${f/,/_}.json"
done
for f in none linear,kv; do
  T=120 step python3 bench/profile_prefill.py --layers 32 --prompt-len 131072 --repeats 1 --fp8 $f --out "$OUT/prefill_prof32_${f/,/_}.json"
done
grep -h "Traceback\|Error" "$LOG" | head
grep -h '"length"\|prefill 131072' "$LOG" | cut -c1-400
