#!/bin/bash
# Device call G (one H200, after the two run_f.sh calls; carry .whl and .smol3/part_ac): SmolLM2 real weights,
# essay text. 1. where a sparse 128K prefill's time goes, device kernels vs wall (bench/profile_prefill.py):
# dense, recall-0.98, recall-0.99; 2. Star 4 blocks and APB 4 hosts at 512K, without sparse and with the
# recall-0.99 config inside (one cold run each; with the default pattern: call C).
LOG=run_g.log; source bench/gpu_env.sh
export STARSHARD_CACHE=/tmp/ss_cache
SMOL=$STARSHARD_CACHE/smollm2-135m-instruct-q4_1-f32
cat /tmp/smol/part_aa /tmp/smol/part_ab .smol3/part_ac > /tmp/smol/smol.gguf
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/smol/smol.gguf" | sha256sum -c || exit 1
T=120 step python3 -m starshard.checkpoints.convert --gguf /tmp/smol/smol.gguf --out "$SMOL" --dtype float32
T=30 step python3 bench/make_essay.py --out /tmp/essay.txt --sentences 40000
R=bench/results/2026-11-25-h200-e2e
R98=bench/results/2026-11-25-cpu-minference-search/smollm2_minference_8k_recall98.json
R99=$R/smollm2_minference_8k_recall99.json
PP="python3 bench/profile_prefill.py --model $SMOL --prompt-file /tmp/essay.txt --prompt-len 131072 --repeats 2"
T=90 step $PP --out $OUT/prof_dense.json
T=90 step $PP --sparse minference --sparse-config $R98 --out $OUT/prof_recall98.json
T=90 step $PP --sparse minference --sparse-config $R99 --out $OUT/prof_recall99.json
P="python3 launch/bench.py prefill --model $SMOL --prompt-file /tmp/essay.txt --dtype bfloat16 --decode-steps 0 --lengths 524288 --warmup 0 --repeats 1"
T=90 step $P --cp-strategy star --num-blocks 4 --out $OUT/star4_512k.json
T=90 step $P --cp-strategy apb --apb-hosts 4 --out $OUT/apb4_512k.json
T=60 step $P --cp-strategy star --num-blocks 4 --sparse minference --sparse-config $R99 --out $OUT/star4_recall99_512k.json
T=60 step $P --cp-strategy apb --apb-hosts 4 --sparse minference --sparse-config $R99 --out $OUT/apb4_recall99_512k.json
grep -h "Traceback\|Error" "$LOG" | head -5
grep -h -A12 "^prefill 131072" "$LOG"
python3 - <<'PY' | tee -a "$LOG"
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/*_512k.json")):
    r = json.load(open(f)); x = r["results"][0]
    print(os.path.basename(f), x["length"], round(x["prefill_seconds"], 4), x.get("sparse_report"))
PY
cd "$OUT" && tar czf run_g_results.tgz *.json && rm -f *.json
