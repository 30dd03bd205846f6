#!/bin/bash
# Call G3 (warm after run_g1.sh / run_g2.sh; carry .whl, .base, .smol3/part_ac): two trees on one machine,
# .base = the session's starting code (8-warp head-dim-128 launches, one set of 2026-11-23 rates) and the
# working tree (launches and rates per head dim). SmolLM2 real weights on essay text (head dim 64): dense
# 128K, MInference with the recall-0.99 config and with the default pattern at 128K (warm-up 1, median of
# 3) and 512K (warm-up 1, one run), each with its sparse report (heads sparse / dense); then the
# never-slower check on the Llama-3.1-8B shape (random weights, head dim 128) at 128K, dense vs
# --sparse minference, working tree only.
LOG=run_g3.log; source bench/gpu_env.sh
smol_model || exit 1
essay
R99=bench/results/2026-11-25-h200-e2e/smollm2_minference_8k_recall99.json
for tree in base new; do
  case $tree in base) ROOT=$PWD/.base;; new) ROOT=$PWD;; esac
  export PYTHONPATH=/tmp/site:$ROOT
  P="python3 $ROOT/launch/bench.py prefill --model $SMOL --prompt-file /tmp/essay.txt --dtype bfloat16 --decode-steps 0 --cp-strategy dense"
  [ $tree = base ] && T=90 step $P --lengths 131072 --warmup 1 --repeats 3 --out $OUT/dense_128k.json
  T=90 step $P --lengths 131072 --warmup 1 --repeats 3 --sparse minference --sparse-config $R99 --out $OUT/${tree}_r99_128k.json
  T=90 step $P --lengths 131072 --warmup 1 --repeats 3 --sparse minference --out $OUT/${tree}_default_128k.json
  T=90 step $P --lengths 524288 --warmup 1 --repeats 1 --sparse minference --sparse-config $R99 --out $OUT/${tree}_r99_512k.json
done
export PYTHONPATH=/tmp/site:$PWD
P8="python3 launch/bench.py prefill $L8B --cp-strategy dense --lengths 131072 --warmup 1 --repeats 1 --decode-steps 0"
T=100 step $P8 --out $OUT/l8b_dense_128k.json
T=100 step $P8 --sparse minference --out $OUT/l8b_minference_128k.json
grep -h "Traceback\|Error" "$LOG" | head
python3 - <<'PY' | tee -a "$LOG"
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/*_*k.json")):
    r = json.load(open(f))
    for x in r.get("results", []):
        print(os.path.basename(f), x["length"], round(x.get("prefill_seconds", -1), 4), x.get("sparse_report"), x.get("error", ""))
PY
cd "$OUT" && tar czf run_g3_results.tgz *.json && rm -f *.json
