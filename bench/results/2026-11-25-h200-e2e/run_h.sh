#!/bin/bash
# Device call H (one H200): one sparse attention call's syncs and time after the fallback plan's two steps
# (the early groups run while the estimate's run cost comes back; ../2026-11-25-h200-index/run_f.sh, TAG=async).
LOG=run_h.log; source bench/gpu_env.sh
R98=bench/results/2026-11-25-cpu-minference-search/smollm2_minference_8k_recall98.json
R99=bench/results/2026-11-25-h200-e2e/smollm2_minference_8k_recall99.json
for c in $R98 $R99; do
  n=$(basename $c .json)
  T=90 step python3 bench/sparse_sync_points.py --config $c --out $OUT/sync_async_$n.json
  T=90 step python3 bench/sparse_sync_points.py --config $c --no-fallback --out $OUT/sync_async_${n}_nofb.json
done
grep -h "Traceback\|Error" "$LOG" | head -5
python3 - <<'PY'
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/sync_*.json")):
    r = json.load(open(f)); print(os.path.basename(f), round(r["ms_per_call"], 3), r["syncs_per_call"]); [print("   ", n, s) for s, n in r["sync_sites"].items()]
PY
