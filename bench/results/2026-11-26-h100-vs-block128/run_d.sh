#!/bin/bash
# One device call (no carry), issue 18 item 3: the AnchorAttention sparse kernel's launch
# (num_warps, num_stages) at 128K, structured inputs, theta 12, Llama-8B heads (32 / 8, d128) with the
# paper's 128-row blocks and with 64-row blocks, and SmolLM2 heads (9 / 3, d64): the built-in choice
# (8 warps for 128-row blocks or d > 64) against 4 warps, as the MInference kernel's sweep (run_b, run_c)
# found 4 warps 2x faster at d128.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; LOG=$OUT/run_d.log
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$LOG"
A="launch/bench.py anchor --device cuda --lengths 131072 --thetas 12 --vs 1000,6096 --repeats 3 --warmup 1"
for bq in 128 64; do
  for l in 8,2 4,2 4,3; do
    echo "=== d128 block_q $bq launch $l" | tee -a "$LOG"
    timeout 60 python3 $A --heads 32 --kv-heads 8 --head-dim 128 --block-q $bq --launch $l --out "$OUT/anchor_d128_bq${bq}_${l/,/_}.json" >>"$LOG" 2>&1
  done
done
for l in 8,2 4,2; do
  echo "=== d64 block_q 128 launch $l" | tee -a "$LOG"
  timeout 60 python3 $A --heads 9 --kv-heads 3 --head-dim 64 --block-q 128 --launch $l --out "$OUT/anchor_d64_bq128_${l/,/_}.json" >>"$LOG" 2>&1
done
python3 - "$OUT" <<'PY' | tee -a "$LOG"
import json, sys, glob, os
for f in sorted(glob.glob(sys.argv[1] + "/anchor_*.json")):
    d = json.load(open(f))
    for r in d.get("results", d.get("rows", [])):
        print(os.path.basename(f), json.dumps(r)[:600])
PY
