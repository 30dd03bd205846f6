#!/bin/bash
# Device call D (one H200, warm after C: checkpoint and essay in /tmp): a recall-0.99 MInference config searched
# on the GPU (SmolLM2, one 8K multikey prompt, float32 as the CPU search), harness accuracy of it and of the
# recall-0.98 config with the Triton index build (200 prompts as ../2026-11-25-h200-index/run_c.sh), and its
# prefill speed at 128K and 512K on essay text.
LOG=run_d.log; source bench/gpu_env.sh
export STARSHARD_CACHE=/tmp/ss_cache
SMOL=$STARSHARD_CACHE/smollm2-135m-instruct-q4_1-f32
test -f "$SMOL/manifest.json" -a -f /tmp/essay.txt || { echo "needs call C's /tmp files" | tee -a "$LOG"; exit 1; }
R98=bench/results/2026-11-25-cpu-minference-search/smollm2_minference_8k_recall98.json
R99=$OUT/smollm2_minference_8k_recall99.json
T=240 step python3 -m starshard.tools.minference_search --model $SMOL --length 8192 --target-recall 0.99 --device cuda --dtype float32 --out $R99
ACC=$OUT/acc; mkdir -p $ACC
E="python3 launch/eval.py --model $SMOL --lengths 1024,2048,4096,8192 --depths 0.1,0.3,0.5,0.7,0.9 --samples-per-cell 2 --seed 7 --tasks passkey,niah_essay,multikey,multiquery,variable_tracking --device cuda --dtype bfloat16 --no-progress"
SP="--sparse-min-length 0 --sparse-no-fallback"
(timeout 300 $E --strategy-name dense --out $ACC/dense > $ACC/dense.log 2>&1; echo "dense rc=$?" | tee -a "$LOG") &
(timeout 300 $E --strategy-name mi-recall98 --sparse minference --sparse-config $R98 $SP --out $ACC/mi-recall98 > $ACC/mi98.log 2>&1; echo "mi-recall98 rc=$?" | tee -a "$LOG") &
if [ -f $R99 ]; then
  (timeout 300 $E --strategy-name mi-recall99 --sparse minference --sparse-config $R99 $SP --out $ACC/mi-recall99 > $ACC/mi99.log 2>&1; echo "mi-recall99 rc=$?" | tee -a "$LOG") &
fi
wait
T=60 step python3 launch/eval.py --compare $ACC/dense $ACC/mi-recall98 $ACC/mi-recall99 --out $ACC/cmp
cp $ACC/cmp/compare.md $OUT/compare_recall.md
P="python3 launch/bench.py prefill --model $SMOL --prompt-file /tmp/essay.txt --dtype bfloat16 --decode-steps 0 --cp-strategy dense"
T=90 step $P --lengths 131072 --warmup 1 --repeats 3 --sparse minference --sparse-config $R99 --out $OUT/mi_recall99_128k.json
T=60 step $P --lengths 524288 --warmup 0 --repeats 1 --sparse minference --sparse-config $R99 --out $OUT/mi_recall99_512k.json
grep -h "overall" $OUT/compare_recall.md | tee -a "$LOG"
grep -h "Traceback\|Error" "$LOG" $ACC/*.log | head
cd "$OUT" && tar czf acc_recall.tgz acc && rm -rf acc
