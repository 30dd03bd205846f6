#!/bin/bash
# Call C: the committed rule (whole-row tiles where K >= 4096 or N < 1024; this tree) vs .alt (whole-row tiles,
# up to 4096, at every shape: Qwen3-30B-A3B's wqkv and LM head too) vs .base; Qwen3-30B-A3B decode 4K / 32K,
# order base, new, alt, new, alt.
LOG=run_c.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
M="launch/bench.py moe --random-weights qwen3-30b-a3b --skip-hf --prefill-lengths 4096 --repeats 1 --decode-contexts 4096,32768 --decode-steps 32"
for run in base_1 new_1 alt_1 new_2 alt_2; do
  tree=${run%_*}; R=$PWD; [ $tree = base ] && R=$PWD/.base; [ $tree = alt ] && R=$PWD/.alt
  PYTHONPATH=/tmp/site:$R T=150 step python3 $R/$M --out "$OUT/moe_c_$run.json"
done
python3 - <<'PY' | tee -a "$LOG"
import glob, json, os
for f in sorted(glob.glob(os.environ["OUT"] + "/moe_c_*.json")):
    print(os.path.basename(f), [(r["context"], round(1e3 * r["step_seconds"], 3)) for r in json.load(open(f))["decode"]])
PY
