#!/bin/bash
# Call H3 (warm after run_g1.sh / run_g2.sh as H1 / H2; carry .whl, .base, .prev, .smol3/part_ac): three
# trees on one machine: .base = ce8acde (session start), .prev = 4a44137 (runs in one launch), the
# working tree (the Vertical-Slash index built whole before the one host read). Index-build bench
# (random q / k), then SmolLM2 real weights on essay text: 128K (warm-up 1, median of 3) and 512K
# (warm-up 1, one timed run) with the recall-0.99 config; then issue 19: Star 2 blocks at 128K on the
# Llama-3.1-8B shape (random weights), --fp8 linear,kv with and without 8-bit attention scores.
LOG=run_h3.log; source bench/gpu_env.sh
smol_model || exit 1
essay
R99=bench/results/2026-11-25-h200-e2e/smollm2_minference_8k_recall99.json
for tree in base prev new; do
  case $tree in base) ROOT=$PWD/.base;; prev) ROOT=$PWD/.prev;; new) ROOT=$PWD;; esac
  PYTHONPATH=/tmp/site:$ROOT step python3 bench/minference_index_bench.py --out $OUT/${tree}_index_smollm2_128k.json
  P="python3 $ROOT/launch/bench.py prefill --model $SMOL --prompt-file /tmp/essay.txt --dtype bfloat16 --decode-steps 0 --cp-strategy dense"
  [ $tree = base ] && T=90 step $P --lengths 131072 --warmup 1 --repeats 3 --out $OUT/dense_128k.json
  T=90 step $P --lengths 131072 --warmup 1 --repeats 3 --sparse minference --sparse-config $R99 --out $OUT/${tree}_r99_128k.json
  T=90 step $P --lengths 524288 --warmup 1 --repeats 1 --sparse minference --sparse-config $R99 --out $OUT/${tree}_r99_512k.json
done
P8="python3 launch/bench.py prefill $L8B --cp-strategy star --num-blocks 2 --lengths 131072 --warmup 1 --repeats 1 --decode-steps 0"
T=200 step $P8 --fp8 linear,kv --out $OUT/l8b_star2_fp8_linear_kv_128k.json
T=200 step $P8 --fp8 linear,kv,attention --out $OUT/l8b_star2_fp8_linear_kv_attention_128k.json
grep -h "Traceback\|Error" "$LOG" | head
grep -hE '"(plan_ms_gpu|plan_ms_wall|index_equal|runs_equal)"' $OUT/*_index_*.json | tee -a "$LOG"
python3 - <<'PY' | tee -a "$LOG"
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/*_*k.json")):
    r = json.load(open(f))
    for x in r.get("results", []):
        print(os.path.basename(f), x["length"], round(x["prefill_seconds"], 4), x.get("sparse_report"))
PY
cd "$OUT" && tar czf run_h3_results.tgz *.json && rm -f *.json
