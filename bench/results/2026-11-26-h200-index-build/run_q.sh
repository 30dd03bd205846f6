#!/bin/bash
# Call Q: issue 18's "never below 0.95x dense" on random weights with the plan that builds the whole
# Vertical-Slash index before its one host read (column lists of heads that then go dense are wasted):
# Llama-3.1-8B shape, random weights, 128K random token ids, dense vs --sparse minference (default
# pattern: dense-like on random weights, the cost model must send every head dense). Warm-up 1, 2 repeats.
LOG=run_q.log; source bench/gpu_env.sh
P="python3 launch/bench.py prefill $L8B --cp-strategy dense --lengths 131072 --warmup 1 --repeats 2 --decode-steps 0"
T=200 step $P --out $OUT/q_l8b_dense_128k.json
T=200 step $P --sparse minference --out $OUT/q_l8b_mi_128k.json
grep -h "Traceback\|Error" "$LOG" | head -5
LOG="$LOG" python3 - <<'PY' | tee -a "$LOG"
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/q_*.json")):
    for x in json.load(open(f))["results"]:
        print(os.path.basename(f), x["length"], round(x["prefill_seconds"], 3), x.get("sparse_report"))
PY
