#!/usr/bin/env bash
# `--fp8 attention` in Ulysses (8-bit scores for the whole-sequence call after the all-to-all), two GPUs,
# carry .whl; the tree of the commit that adds this script. First the CUDA checks (ring, Ulysses and
# Ulysses with 8-bit scores over NCCL against float64, the dispatcher, the merges), then Llama-3.1-8B
# shape prefill over Ulysses cp = 2 at 64K / 128K, random bf16 weights (fine for dense and CP speed),
# bf16, `--fp8 linear,kv` and `--fp8 linear,kv,attention`, warm-up 1, median of 2.
LOG=run.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$LOG"
T=120 step torchrun --nproc-per-node 2 launch/gpu_check.py --cp
grep -h '"ok": false' "$LOG" | head
W="--lengths 65536,131072 --warmup 1 --repeats 2 --decode-steps 0"
for fp8 in none linear,kv linear,kv,attention; do
  T=150 step torchrun --nproc-per-node 2 launch/bench.py prefill $L8B --cp 2 --cp-strategy ulysses --fp8 $fp8 $W --out "$OUT/ulysses_cp2_${fp8//,/_}.json"
done
grep -h "Traceback\|Error" "$LOG" | head
grep -h '"check": "cp/' "$LOG" | cut -c1-200
python3 - "$OUT"/ulysses_cp2_*.json <<'PY'
import json, sys
for p in sys.argv[1:]:
    d = json.load(open(p))
    print(d["fp8"], [(r["length"], round(r["prefill_seconds"], 3)) for r in d["results"]])
PY
