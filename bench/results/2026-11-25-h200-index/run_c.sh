#!/bin/bash
# Device call C (one H200, warm after calls A and B; carry .whl and .smol3/part_ac). SmolLM2-135M real weights:
# 1. harness accuracy of the recall-0.98 MInference config (../2026-11-25-cpu-minference-search/), 200 prompts
#    paired with ../2026-11-25-h200/run_f.sh's (same seed and cells) and a dense run of its own;
# 2. prefill at 128K on essay text: dense, MInference default / searched (equal cost) / recall-0.98, each
#    with the index build's torch ops and with its Triton launches (bench/with_index_build.py triton);
# 3. per-component times at 128K (layer 15) with the Triton index build (compare ../2026-11-25-h200/run_h.sh).
# Ran at 5b8b966 (index build torch by default, the triton runs through the wrapper then named
# bench/with_triton_index.py); written here as it runs on later commits.
LOG=run_c.log; source bench/gpu_env.sh
export STARSHARD_CACHE=/tmp/ss_cache
SMOL=$STARSHARD_CACHE/smollm2-135m-instruct-q4_1-f32
if [ ! -f "$SMOL/manifest.json" ]; then
  cat /tmp/smol/part_aa /tmp/smol/part_ab .smol3/part_ac > /tmp/smol/smol.gguf
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/smol/smol.gguf" | sha256sum -c || exit 1
  T=120 step python3 -m starshard.checkpoints.convert --gguf /tmp/smol/smol.gguf --out "$SMOL" --dtype float32
fi
R98=bench/results/2026-11-25-cpu-minference-search/smollm2_minference_8k_recall98.json
MI=bench/results/2026-11-23-h200-accuracy/smollm2_minference_8k.json
ACC=$OUT/acc; mkdir -p $ACC
E="python3 launch/eval.py --model $SMOL --lengths 1024,2048,4096,8192 --depths 0.1,0.3,0.5,0.7,0.9 --samples-per-cell 2 --seed 7 --tasks passkey,niah_essay,multikey,multiquery,variable_tracking --device cuda --dtype bfloat16 --no-progress"
SP="--sparse-min-length 0 --sparse-no-fallback"
echo "=== evals ($(date +%T))" | tee -a "$LOG"
(timeout 400 $E --strategy-name dense --out $ACC/dense > $ACC/dense.log 2>&1; echo "dense rc=$?" | tee -a "$LOG") &
(timeout 400 $E --strategy-name mi-recall98 --sparse minference --sparse-config $R98 $SP --out $ACC/mi-recall98 > $ACC/mi.log 2>&1; echo "mi-recall98 rc=$?" | tee -a "$LOG") &
T=30 step python3 bench/make_essay.py --out /tmp/essay.txt --sentences 40000
wait
echo "=== evals done ($(date +%T))" | tee -a "$LOG"
T=60 step python3 launch/eval.py --compare $ACC/dense $ACC/mi-recall98 --out $ACC/cmp
cp $ACC/cmp/compare.md $OUT/compare_recall98.md
P="launch/bench.py prefill --model $SMOL --prompt-file /tmp/essay.txt --dtype bfloat16 --decode-steps 0 --cp-strategy dense --lengths 131072 --warmup 1 --repeats 3"
T=120 step python3 $P --out $OUT/dense_128k.json
for tag in torch triton; do
  RUN="python3 bench/with_index_build.py $tag"
  T=120 step $RUN $P --sparse minference --out $OUT/mi_default_128k_$tag.json
  T=120 step $RUN $P --sparse minference --sparse-config $MI --out $OUT/mi_searched_128k_$tag.json
  T=120 step $RUN $P --sparse minference --sparse-config $R98 --out $OUT/mi_recall98_128k_$tag.json
done
T=150 step python3 bench/with_index_build.py triton bench/sparse_components.py --model $SMOL --length 131072 --layers 15 --no-flash --repeats 5 --warmup 2 --minference-config $R98 --skip-anchor --out $OUT/sparse_components_128k_triton.json
grep -h "overall" $OUT/compare_recall98.md | tee -a "$LOG"
grep -h "Traceback\|Error" "$LOG" $ACC/*.log | head
cd "$OUT" && tar czf acc_recall98.tgz acc && rm -rf acc
