#!/bin/bash
# Device call D (one H200, warm after call C, which copied the GGUF's first half to /tmp/smol): harness
# accuracy of every --fp8 choice on a larger, independent sample: launch/eval.py on SmolLM2-135M real
# weights in bf16, 1K-8K, 5 tasks x 5 depths x 4 samples per cell, seed 11 (400 prompts per configuration;
# 2026-11-24's run_g.sh: 200 prompts, seed 7), four configurations at a time; then eval.py --compare.
LOG=run_d.log; source bench/gpu_env.sh
export STARSHARD_CACHE=/tmp/ss_cache
SMOL=$STARSHARD_CACHE/smollm2-135m-instruct-q4_1-f32
if [ ! -f "$SMOL/manifest.json" ]; then
  cat /tmp/smol/part_aa .smol/part_ab > /tmp/smol/smol.gguf
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/smol/smol.gguf" | sha256sum -c || exit 1
  T=120 step python3 -m starshard.checkpoints.convert --gguf /tmp/smol/smol.gguf --out "$SMOL" --dtype float32
fi
ACC=$OUT/acc; mkdir -p $ACC
E="python3 launch/eval.py --model $SMOL --lengths 1024,2048,4096,8192 --depths 0.1,0.3,0.5,0.7,0.9 --samples-per-cell 4 --seed 11 --tasks passkey,niah_essay,multikey,multiquery,variable_tracking --device cuda --dtype bfloat16 --no-progress"
for f in none linear kv linear,kv; do
  name=fp8-${f/,/-}
  echo "=== eval $name ($(date +%T))" | tee -a "$LOG"
  (timeout 480 $E --fp8 $f --strategy-name "$name" --out "$ACC/$name" >"$ACC/$name.log" 2>&1; echo "$name rc=$? ($(date +%T))" | tee -a "$LOG") &
done
wait
T=60 step python3 launch/eval.py --compare $ACC/fp8-none $ACC/fp8-linear $ACC/fp8-kv $ACC/fp8-linear-kv --out $ACC
cp $ACC/compare.md "$OUT/compare_fp8_d.md"
grep -h "Traceback\|Error" "$LOG" $ACC/*.log | head
head -30 "$OUT/compare_fp8_d.md" | tee -a "$LOG"
cd "$OUT" && tar czf acc_fp8_d.tgz acc && rm -rf acc
