#!/bin/bash
# Device call F (one H200, warm after call E: the SmolLM2 checkpoint in /tmp/ss_cache): harness accuracy
# of the single-device sparse configurations (2026-11-23-h200-sparse-accuracy: 40 prompts) on 200 prompts each
# (2026-11-23-h200-sparse-accuracy), on 200 prompts each (5 tasks x 5 depths x 2 samples, seed 7, 1K-8K):
# Star 4 blocks and APB 4 hosts, alone and with MInference default / calibrated AnchorAttention 128 x 16
# inside; sparse ones with --sparse-min-length 0 --sparse-no-fallback (else <= 64K keys run dense).
LOG=run_f.log; source bench/gpu_env.sh
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
MI=bench/results/2026-11-23-h200-accuracy/smollm2_minference_8k.json
A64=bench/results/2026-11-23-h200-sparse-realweights/anchor_smollm2_64x4.json
ev dense
ev mi-default --sparse minference $SP
ev mi-searched --sparse minference --sparse-config $MI $SP
ev anchor-128x16 --sparse anchor --sparse-config $A128 $SP
ev anchor-64x4 --sparse anchor --sparse-config $A64 $SP
wait
T=60 step python3 launch/eval.py --compare $ACC/dense $ACC/mi-default $ACC/mi-searched $ACC/anchor-128x16 $ACC/anchor-64x4 --out $ACC/one
cp $ACC/one/compare.md "$OUT/compare_sparse_f.md"
grep -h "Traceback\|Error" "$LOG" $ACC/*.log | head
grep -h "overall" "$OUT"/compare_sparse_f.md | tee -a "$LOG"
cd "$OUT" && tar czf acc_sparse_f.tgz acc && rm -rf acc
