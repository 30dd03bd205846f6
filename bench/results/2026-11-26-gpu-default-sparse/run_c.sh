#!/bin/bash
# Call C (warm after A / B; carry .smol3/part_ac): the embedded default model with `--sparse minference` and no
# --sparse-config takes its shipped recall-0.99 patterns (tree ca5f487). SmolLM2-135M real weights, essay text,
# 128K, warm-up 1, median of 3: dense; `--sparse minference` without --model (the embedded default: the shipped
# config); `--sparse minference --model <the same converted checkpoint>` (a model path: the built-in pattern).
LOG=run_c.log; source bench/gpu_env.sh
smol_model || exit 1
essay
P="python3 launch/bench.py prefill --prompt-file /tmp/essay.txt --dtype bfloat16 --decode-steps 0 --cp-strategy dense --lengths 131072 --warmup 1 --repeats 3"
T=120 step $P --model $SMOL --out $OUT/dense_128k.json
T=120 step $P --sparse minference --out $OUT/default_model_128k.json
T=120 step $P --sparse minference --model $SMOL --out $OUT/model_path_128k.json
grep -h "Traceback\|Error" "$LOG" | head
python3 - <<'PY' | tee -a "$LOG"
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/*_128k.json")):
    r = json.load(open(f))
    for x in r["results"]:
        print(os.path.basename(f), r.get("sparse_config_file"), x["length"], round(x["prefill_seconds"], 4), x["all_seconds"],
              x.get("sparse_report"))
PY
