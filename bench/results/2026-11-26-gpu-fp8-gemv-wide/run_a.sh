#!/bin/bash
# The e4m3 decode GEMV's tile for wo (kernels/fp8.py GEMV_OTHER, 4 x 1024 x 4) against .alt's whole-row 4 x 4096 x 4
# (wo's weights all requested before the attention kernel ahead ends, PDL), .base = HEAD (cad282c): Llama-3.1-8B
# `--fp8 linear,kv`, 8K prompt + 128 graph decode steps and 128K prompt + 128 steps, base, alt, base, alt.
# Random weights: fine for decode speed.
LOG=run_a.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
P="launch/bench.py prefill $L8B --cp-strategy dense --lengths 8192,131072 --warmup 0 --repeats 1 --decode-steps 128 --fp8 linear,kv"
for run in base_1 alt_1 base_2 alt_2; do
  tree=${run%_*}; R=$PWD/.$tree
  PYTHONPATH=/tmp/site:$R T=150 step python3 $R/$P --out "$OUT/fp8_$run.json"
done
grep -h "Traceback\|Error" "$LOG" | head
python3 - <<'PY' | tee -a "$LOG"
import glob, json, os
for f in sorted(glob.glob(os.environ["OUT"] + "/fp8_*.json")):
    print(os.path.basename(f), [(x["length"], round(1e3 * x["decode"]["step_seconds"], 3)) for x in json.load(open(f))["results"]])
PY
