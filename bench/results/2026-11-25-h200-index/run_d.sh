#!/bin/bash
# Device call D (one H200, warm after call C: the SmolLM2 checkpoint and the essay in /tmp): prefill at 512K on
# essay text, one cold run each (as ../2026-11-23-h200-sparse-realweights/run.sh): dense, MInference default /
# searched / recall-0.98 and Star 4 / APB 4 with MInference inside, the index build's Triton launches on.
LOG=run_d.log; source bench/gpu_env.sh
export STARSHARD_CACHE=/tmp/ss_cache
SMOL=$STARSHARD_CACHE/smollm2-135m-instruct-q4_1-f32
test -f "$SMOL/manifest.json" -a -f /tmp/essay.txt || { echo "needs call C's /tmp files" | tee -a "$LOG"; exit 1; }
R98=bench/results/2026-11-25-cpu-minference-search/smollm2_minference_8k_recall98.json
MI=bench/results/2026-11-23-h200-accuracy/smollm2_minference_8k.json
P="launch/bench.py prefill --model $SMOL --prompt-file /tmp/essay.txt --dtype bfloat16 --decode-steps 0 --lengths 524288 --warmup 0 --repeats 1"
TR="python3 bench/with_index_build.py triton"
T=100 step python3 $P --cp-strategy dense --out $OUT/dense_512k.json
T=60 step $TR $P --cp-strategy dense --sparse minference --out $OUT/mi_default_512k_triton.json
T=60 step $TR $P --cp-strategy dense --sparse minference --sparse-config $MI --out $OUT/mi_searched_512k_triton.json
T=60 step $TR $P --cp-strategy dense --sparse minference --sparse-config $R98 --out $OUT/mi_recall98_512k_triton.json
T=60 step $TR $P --cp-strategy star --num-blocks 4 --sparse minference --out $OUT/star4_mi_512k_triton.json
T=60 step $TR $P --cp-strategy apb --apb-hosts 4 --sparse minference --out $OUT/apb4_mi_512k_triton.json
T=60 step $TR $P --cp-strategy star --num-blocks 4 --sparse minference --sparse-config $R98 --out $OUT/star4_mi_recall98_512k_triton.json
T=60 step $TR $P --cp-strategy apb --apb-hosts 4 --sparse minference --sparse-config $R98 --out $OUT/apb4_mi_recall98_512k_triton.json
grep -h "Traceback\|Error" "$LOG" | head
grep -h '"prefill_seconds"' $OUT/*.json | cut -c1-200
