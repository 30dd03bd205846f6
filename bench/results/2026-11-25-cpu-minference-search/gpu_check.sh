#!/bin/bash
# Written 2026-11-25, NOT RUN (the session's device time was spent): one H200, two calls (the SmolLM2 GGUF in
# halves: first call `mkdir -p /tmp/smol && cp .smol/part_aa /tmp/smol/` carrying .smol/part_aa only, then
# this script carrying .whl and .smol/part_ab). Measures the recall-floor MInference config searched on the
# CPU (smollm2_minference_8k_recall98.json): harness accuracy on the 200 prompts of
# ../2026-11-25-h200/run_f.sh (same seed, so --compare pairs them with that run's dense / default / searched
# rows), and prefill speed at 128K on essay text against dense and the default pattern.
LOG=gpu_check.log; source bench/gpu_env.sh
export STARSHARD_CACHE=/tmp/ss_cache PYTHON=python3
SMOL=$STARSHARD_CACHE/smollm2-135m-instruct-q4_1-f32
R=bench/results/2026-11-25-cpu-minference-search
CFG=$R/smollm2_minference_8k_recall98.json
if [ ! -f "$SMOL/manifest.json" ]; then
  cat /tmp/smol/part_aa .smol/part_ab > /tmp/smol/smol.gguf
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/smol/smol.gguf" | sha256sum -c || exit 1
  T=120 step python3 -m starshard.checkpoints.convert --gguf /tmp/smol/smol.gguf --out "$SMOL" --dtype float32
fi
ACC=$OUT/acc; mkdir -p $ACC
E="python3 launch/eval.py --model $SMOL --lengths 1024,2048,4096,8192 --depths 0.1,0.3,0.5,0.7,0.9 --samples-per-cell 2 --seed 7 --tasks passkey,niah_essay,multikey,multiquery,variable_tracking --device cuda --dtype bfloat16 --no-progress"
(timeout 400 $E --strategy-name dense --out $ACC/dense > $ACC/dense.log 2>&1) &
(timeout 400 $E --strategy-name mi-recall98 --sparse minference --sparse-config $CFG --sparse-min-length 0 --sparse-no-fallback --out $ACC/mi-recall98 > $ACC/mi.log 2>&1) &
T=30 step python3 bench/make_essay.py --out /tmp/essay.txt --sentences 40000
P="python3 launch/bench.py prefill --model $SMOL --prompt-file /tmp/essay.txt --dtype bfloat16 --decode-steps 0 --cp-strategy dense --lengths 131072 --warmup 1 --repeats 3"
wait
T=200 step $P --sparse minference --sparse-config $CFG --out $OUT/mi_recall98_128k.json
T=120 step $P --out $OUT/dense_128k.json
T=120 step $P --sparse minference --out $OUT/mi_default_128k.json
T=60 step python3 launch/eval.py --compare $ACC/dense $ACC/mi-recall98 --out $ACC
cp $ACC/compare.md $OUT/compare_recall98.md
grep -h "Traceback\|Error" "$LOG" $ACC/*.log | head
