#!/bin/bash
# Call C2 (carries the last third): what fast accumulation in the e4m3 GEMM costs in accuracy, SmolLM2-135M
# real weights. 1) bench/fp8_fidelity.py (prompt logits / teacher-forced decode vs float32, greedy tokens)
# with STARSHARD_FP8_FAST_ACCUM=1 (the new default) and 0; 2) the harness (launch/eval.py, bf16, 1K-8K,
# 5 tasks x 5 depths x 4 samples, seed 11 = 2026-11-25-h200/run_d.sh's 400 prompts): none, linear,kv with
# fast accumulation, linear,kv without, in parallel; then --compare.
LOG=run_c2.log; source bench/gpu_env.sh; smol_model || exit 1
for fa in 1 0; do
  STARSHARD_FP8_FAST_ACCUM=$fa T=200 step python3 bench/fp8_fidelity.py --device cuda --dtype float32 --length 4096 \
    --configs bf16,linear,linear+kv --out "$OUT/fidelity_fast$fa.json"
done
ACC=/tmp/acc; mkdir -p $ACC
E="python3 launch/eval.py --model $SMOL --lengths 1024,2048,4096,8192 --depths 0.1,0.3,0.5,0.7,0.9 --samples-per-cell 4 --seed 11 --tasks passkey,niah_essay,multikey,multiquery,variable_tracking --device cuda --dtype bfloat16 --no-progress"
for cfg in "none 1" "linear,kv 1" "linear,kv 0"; do
  set -- $cfg; name=fp8-${1/,/-}-fast$2
  echo "=== eval $name ($(date +%T))" | tee -a "$LOG"
  (STARSHARD_FP8_FAST_ACCUM=$2 timeout 420 $E --fp8 $1 --strategy-name "$name" --out "$ACC/$name" >"$ACC/$name.log" 2>&1; echo "$name rc=$? ($(date +%T))" | tee -a "$LOG") &
done
wait
T=60 step python3 launch/eval.py --compare $ACC/fp8-none-fast1 $ACC/fp8-linear-kv-fast1 $ACC/fp8-linear-kv-fast0 --out $ACC
cp $ACC/compare.md "$OUT/compare_fast_accum.md"
grep -h "Traceback\|Error" "$LOG" $ACC/*.log | head
head -30 "$OUT/compare_fast_accum.md" | tee -a "$LOG"
cd /tmp && tar czf "$OUT/acc_fast_accum.tgz" acc
