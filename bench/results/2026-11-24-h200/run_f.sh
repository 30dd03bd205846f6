#!/usr/bin/env bash
# One H200, 2026-11-24, sixth call: issue 19 item 5 on the GPU kernels (the 2026-11-23 harness numbers were
# the CPU reference path): launch/eval.py on SmolLM2-135M real weights in bf16, 1K-8K, 5 tasks x 2 depths
# (40 prompts per configuration), --fp8 none / linear / kv / linear,kv, four at a time; then eval.py --compare.
# Needs the SmolLM2 GGUF: .smol/part_ab carried, part_aa copied to /tmp/smol by a first call
# (mkdir -p /tmp/smol && cp .smol/part_aa /tmp/smol/), as 2026-11-23-h200-sparse-accuracy/run.sh.
LOG=run_f.log; source bench/gpu_env.sh
export STARSHARD_CACHE=/tmp/ss_cache
SMOL=$STARSHARD_CACHE/smollm2-135m-instruct-q4_1-f32
cat /tmp/smol/part_aa .smol/part_ab > /tmp/smol/smol.gguf
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/smol/smol.gguf" | sha256sum -c || exit 1
T=120 step python3 -m starshard.checkpoints.convert --gguf /tmp/smol/smol.gguf --out "$SMOL" --dtype float32
ACC=$OUT/acc; mkdir -p $ACC
E="python3 launch/eval.py --model $SMOL --lengths 1024,2048,4096,8192 --depths 0.25,0.75 --tasks passkey,niah_essay,multikey,multiquery,variable_tracking --device cuda --dtype bfloat16 --no-progress"
for f in none linear kv linear,kv; do
  name=fp8-${f/,/-}
  echo "=== eval $name ($(date +%T))" | tee -a "$LOG"
  (timeout 240 $E --fp8 $f --strategy-name "$name" --out "$ACC/$name" >"$ACC/$name.log" 2>&1; echo "$name rc=$?" | tee -a "$LOG") &
done
wait
T=60 step python3 launch/eval.py --compare $ACC/fp8-none $ACC/fp8-linear $ACC/fp8-kv $ACC/fp8-linear-kv --out $ACC
cp $ACC/compare.md "$OUT/compare_fp8.md"
grep -h "Traceback\|Error" "$LOG" $ACC/*.log | head
cat "$OUT/compare_fp8.md" | head -40 | tee -a "$LOG"
cd "$OUT" && tar czf acc_fp8.tgz acc && rm -rf acc
