#!/bin/bash
# Device call C (warm after A and B; carry .whl and .smol3/part_ac): SmolLM2-135M real weights, essay text,
# 512K, warm-up 1 and one timed run as ../2026-11-25-h200-e2e/run_k.sh, after APB's one sparse call over
# [anchor; passing; own block] (a943808) and the dispatcher's gapped-causal change (e545dc9, 53b51ea):
# APB 4 hosts and Star 4 blocks, each without sparse, with the recall-0.99 config and with the default
# pattern inside.
LOG=run_c.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
smol_model || { echo "no model" | tee -a "$LOG"; exit 1; }
essay
R99=bench/results/2026-11-25-h200-e2e/smollm2_minference_8k_recall99.json
P="python3 launch/bench.py prefill --model $SMOL --prompt-file /tmp/essay.txt --dtype bfloat16 --decode-steps 0 --lengths 524288 --warmup 1 --repeats 1"
T=60 step $P --cp-strategy apb --apb-hosts 4 --out $OUT/apb4_512k.json
T=60 step $P --cp-strategy apb --apb-hosts 4 --sparse minference --sparse-config $R99 --out $OUT/apb4_recall99_512k.json
T=60 step $P --cp-strategy apb --apb-hosts 4 --sparse minference --out $OUT/apb4_mi_512k.json
T=150 step $P --cp-strategy star --num-blocks 4 --out $OUT/star4_512k.json
T=60 step $P --cp-strategy star --num-blocks 4 --sparse minference --sparse-config $R99 --out $OUT/star4_recall99_512k.json
grep -h "Traceback\|Error" "$LOG" | head -5
python3 - <<'PY' | tee -a "$LOG"
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/*_512k.json")):
    r = json.load(open(f)); x = r["results"][0]
    print(os.path.basename(f), round(x["prefill_seconds"], 4), x["all_seconds"], x.get("sparse_report"))
PY
