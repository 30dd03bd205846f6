#!/bin/bash
# Device call K (one H200, warm after J): the 512K baselines warm as in call J (warm-up 1, one timed run):
# dense, Star 4 and APB 4 without sparse, APB 4 with the recall-0.99 config (tree 417f8c0).
LOG=run_k.log; source bench/gpu_env.sh
SMOL=/tmp/ss_cache/smollm2-135m-instruct-q4_1-f32
R99=bench/results/2026-11-25-h200-e2e/smollm2_minference_8k_recall99.json
P="python3 launch/bench.py prefill --model $SMOL --prompt-file /tmp/essay.txt --dtype bfloat16 --decode-steps 0 --lengths 524288 --warmup 1 --repeats 1"
T=150 step $P --cp-strategy dense --out $OUT/k_dense_512k.json
T=150 step $P --cp-strategy star --num-blocks 4 --out $OUT/k_star4_512k.json
T=60 step $P --cp-strategy apb --apb-hosts 4 --out $OUT/k_apb4_512k.json
T=60 step $P --cp-strategy apb --apb-hosts 4 --sparse minference --sparse-config $R99 --out $OUT/k_apb4_recall99_512k.json
python3 - <<'PY' | tee -a "$LOG"
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/k_*.json")):
    r = json.load(open(f)); x = r["results"][0]
    print(os.path.basename(f), round(x["prefill_seconds"], 4), x["all_seconds"], x.get("sparse_report"))
PY
