#!/bin/bash
# Device call F (one H200): host syncs of one sparse prefill attention call and its time, random bf16 inputs
# at SmolLM2 shapes, 128K (bench/sparse_sync_points.py), default pattern and the recall-0.98 config, the index
# build's torch ops and Triton launches. TAG names the code state (before / after the sync removal).
LOG=run_f_${TAG:-x}.log; source bench/gpu_env.sh
R98=bench/results/2026-11-25-cpu-minference-search/smollm2_minference_8k_recall98.json
for t in torch triton; do
  tr="bench/with_index_build.py $t"
  T=90 step python3 $tr bench/sparse_sync_points.py --out $OUT/sync_${TAG:-x}_default_$t.json
  T=90 step python3 $tr bench/sparse_sync_points.py --config $R98 --out $OUT/sync_${TAG:-x}_recall98_$t.json
  T=90 step python3 $tr bench/sparse_sync_points.py --config $R98 --no-fallback --out $OUT/sync_${TAG:-x}_recall98_nofb_$t.json
done
grep -h "Traceback\|Error" "$LOG" | head -5
python3 - <<'PY'
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/sync_*.json")):
    r = json.load(open(f)); print(os.path.basename(f), round(r["ms_per_call"], 3), r["syncs_per_call"]); [print("   ", n, s) for s, n in r["sync_sites"].items()]
PY
