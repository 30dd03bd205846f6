#!/bin/bash
# Call G3 (warm after G1 / G2; carry .whl, .base and .smol3/part_ac): SmolLM2-135M real weights, essay
# text, end to end prefill before (.base = ce8acde, the session's start: its starshard/ and launch/) and
# after (the working tree), same machine: 128K (warm-up 1, median of 3) dense / MInference recall-0.99
# config / default pattern; 512K one cold run each: dense, recall-0.99, Star 4 and APB 4 without and
# with recall-0.99 inside (new tree only). First the index build bench (random q / k; the column
# lists' kernel now searches the used runs only).
LOG=run_g3.log; source bench/gpu_env.sh
step python3 bench/minference_index_bench.py --out $OUT/index_new_smollm2_128k.json --profile
smol_model || exit 1
essay
R99=bench/results/2026-11-25-h200-e2e/smollm2_minference_8k_recall99.json
for tree in base new; do
  if [ $tree = base ]; then ROOT=$PWD/.base; else ROOT=$PWD; fi
  P="python3 $ROOT/launch/bench.py prefill --model $SMOL --prompt-file /tmp/essay.txt --dtype bfloat16 --decode-steps 0"
  P128="$P --cp-strategy dense --lengths 131072 --warmup 1 --repeats 3"
  [ $tree = base ] && T=90 step $P128 --out $OUT/dense_128k.json
  T=90 step $P128 --sparse minference --sparse-config $R99 --out $OUT/${tree}_r99_128k.json
  T=90 step $P128 --sparse minference --out $OUT/${tree}_default_128k.json
  P512="$P --lengths 524288 --warmup 0 --repeats 1"
  [ $tree = base ] && T=100 step $P512 --cp-strategy dense --out $OUT/dense_512k.json
  T=60 step $P512 --cp-strategy dense --sparse minference --sparse-config $R99 --out $OUT/${tree}_r99_512k.json
done
P512="python3 launch/bench.py prefill --model $SMOL --prompt-file /tmp/essay.txt --dtype bfloat16 --decode-steps 0 --lengths 524288 --warmup 0 --repeats 1"
T=100 step $P512 --cp-strategy star --num-blocks 4 --out $OUT/star4_512k.json
T=60 step $P512 --cp-strategy star --num-blocks 4 --sparse minference --sparse-config $R99 --out $OUT/star4_r99_512k.json
T=100 step $P512 --cp-strategy apb --apb-hosts 4 --out $OUT/apb4_512k.json
T=60 step $P512 --cp-strategy apb --apb-hosts 4 --sparse minference --sparse-config $R99 --out $OUT/apb4_r99_512k.json
grep -h "Traceback\|Error" "$LOG" | head
python3 - <<'PY' | tee -a "$LOG"
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/*_*k.json")):
    r = json.load(open(f))
    for x in r.get("results", []):
        print(os.path.basename(f), x["length"], round(x["prefill_seconds"], 4), x.get("sparse_report"))
PY
cd "$OUT" && tar czf run_g3_results.tgz *.json && rm -f *.json
