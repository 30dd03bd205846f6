#!/bin/bash
# Device call E (one H200, warm after call D: the SmolLM2 checkpoint in /tmp/ss_cache): harness accuracy
# of the sparse configurations that were at or under issue 18's 0.97 bar on 40 prompts
# (2026-11-23-h200-sparse-accuracy), on 200 prompts each (5 tasks x 5 depths x 2 samples, seed 7, 1K-8K):
# Star 4 blocks and APB 4 hosts, alone and with MInference default / calibrated AnchorAttention 128 x 16
# inside; sparse ones with --sparse-min-length 0 --sparse-no-fallback (else <= 64K keys run dense).
LOG=run_e.log; source bench/gpu_env.sh
export STARSHARD_CACHE=/tmp/ss_cache
SMOL=$STARSHARD_CACHE/smollm2-135m-instruct-q4_1-f32
test -f "$SMOL/manifest.json" || { echo "needs call D's checkpoint in /tmp" | tee -a "$LOG"; exit 1; }
A128=bench/results/2026-11-23-h200-sparse-realweights/anchor_smollm2_128x16.json
ACC=$OUT/acc; mkdir -p $ACC
E="python3 launch/eval.py --model $SMOL --lengths 1024,2048,4096,8192 --depths 0.1,0.3,0.5,0.7,0.9 --samples-per-cell 2 --seed 7 --tasks passkey,niah_essay,multikey,multiquery,variable_tracking --device cuda --dtype bfloat16 --no-progress"
SP="--sparse-min-length 0 --sparse-no-fallback"
ev() {  # NAME [flags...], in the background; its own log
  local name=$1; shift
  echo "=== eval $name: $* ($(date +%T))" | tee -a "$LOG"
  (timeout 540 $E --strategy-name "$name" --out "$ACC/$name" "$@" >"$ACC/$name.log" 2>&1; echo "$name rc=$? ($(date +%T))" | tee -a "$LOG") &
}
ev star4 --cp-strategy star --num-blocks 4
ev star4-mi-default --cp-strategy star --num-blocks 4 --sparse minference $SP
ev star4-anchor-128x16 --cp-strategy star --num-blocks 4 --sparse anchor --sparse-config $A128 $SP
ev apb4 --cp-strategy apb --apb-hosts 4
ev apb4-mi-default --cp-strategy apb --apb-hosts 4 --sparse minference $SP
ev apb4-anchor-128x16 --cp-strategy apb --apb-hosts 4 --sparse anchor --sparse-config $A128 $SP
wait
T=60 step python3 launch/eval.py --compare $ACC/star4 $ACC/star4-mi-default $ACC/star4-anchor-128x16 --out $ACC/star
T=60 step python3 launch/eval.py --compare $ACC/apb4 $ACC/apb4-mi-default $ACC/apb4-anchor-128x16 --out $ACC/apb
cp $ACC/star/compare.md "$OUT/compare_star4_e.md"; cp $ACC/apb/compare.md "$OUT/compare_apb4_e.md"
grep -h "Traceback\|Error" "$LOG" $ACC/*.log | head
grep -h "overall" "$OUT"/compare_*_e.md | tee -a "$LOG"
cd "$OUT" && tar czf acc_sparse_e.tgz acc && rm -rf acc
