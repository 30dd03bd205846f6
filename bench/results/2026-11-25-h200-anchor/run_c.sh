#!/bin/bash
# Device call C (one H200, after calls A and B kept the GGUF's first two thirds in /tmp; carry .whl and
# .smol3/part_ac): AnchorAttention calibrated per head at higher recall floors (0.98, 0.99; the 0.95 files of
# 2026-11-23 kept 0.92 of dense on the harness), 128-row pooling, 16 blocks per selection, SmolLM2 at 8K on 3
# harness prompts as before; their harness accuracy (the 200 prompts of ../2026-11-25-h200-e2e/run_d.sh) and
# prefill speed at 128K on essay text.
LOG=run_c.log; source bench/gpu_env.sh
export STARSHARD_CACHE=/tmp/ss_cache
SMOL=$STARSHARD_CACHE/smollm2-135m-instruct-q4_1-f32
cat /tmp/smol/part_aa /tmp/smol/part_ab .smol3/part_ac > /tmp/smol/smol.gguf
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/smol/smol.gguf" | sha256sum -c || exit 1
T=120 step python3 -m starshard.checkpoints.convert --gguf /tmp/smol/smol.gguf --out "$SMOL" --dtype float32
T=30 step python3 bench/make_essay.py --out /tmp/essay.txt --sentences 40000
C="python3 -m starshard.tools.anchor_calibrate --model $SMOL --length 8192 --samples 3 --device cuda --quiet --block-q 128 --step 16"
T=100 step $C --target-recall 0.98 --out $OUT/anchor_smollm2_128x16_r98.json
T=100 step $C --target-recall 0.99 --out $OUT/anchor_smollm2_128x16_r99.json
ACC=$OUT/acc; mkdir -p $ACC
E="python3 launch/eval.py --model $SMOL --lengths 1024,2048,4096,8192 --depths 0.1,0.3,0.5,0.7,0.9 --samples-per-cell 2 --seed 7 --tasks passkey,niah_essay,multikey,multiquery,variable_tracking --device cuda --dtype bfloat16 --no-progress"
SP="--sparse-min-length 0 --sparse-no-fallback"
(timeout 300 $E --strategy-name dense --out $ACC/dense > $ACC/dense.log 2>&1; echo "dense rc=$?" | tee -a "$LOG") &
for r in r98 r99; do
  (timeout 300 $E --strategy-name anchor-$r --sparse anchor --sparse-config $OUT/anchor_smollm2_128x16_$r.json $SP --out $ACC/anchor-$r > $ACC/$r.log 2>&1; echo "anchor-$r rc=$?" | tee -a "$LOG") &
done
wait
T=60 step python3 launch/eval.py --compare $ACC/dense $ACC/anchor-r98 $ACC/anchor-r99 --out $ACC/cmp
cp $ACC/cmp/compare.md $OUT/compare_anchor.md
P="python3 launch/bench.py prefill --model $SMOL --prompt-file /tmp/essay.txt --dtype bfloat16 --decode-steps 0 --cp-strategy dense --lengths 131072 --warmup 1 --repeats 3"
T=90 step $P --out $OUT/dense_128k.json
for r in r98 r99; do
  T=120 step $P --sparse anchor --sparse-config $OUT/anchor_smollm2_128x16_$r.json --out $OUT/anchor_${r}_128k.json
done
grep -h "overall" $OUT/compare_anchor.md | tee -a "$LOG"
grep -h "Traceback\|Error" "$LOG" $ACC/*.log | head
python3 - <<'PY' | tee -a "$LOG"
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/*_128k.json")):
    r = json.load(open(f)); x = r["results"][0]
    print(os.path.basename(f), round(x["prefill_seconds"], 4), x["all_seconds"], x.get("sparse_report"))
PY
cd "$OUT" && tar czf acc_anchor.tgz acc && rm -rf acc
