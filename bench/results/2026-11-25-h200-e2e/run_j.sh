#!/bin/bash
# Device call J (one H200, after two run_f.sh calls; carry .whl, .smol3/part_ac and bench/old_46b0cef, the
# starshard package of 46b0cef): 512K prefill, warm (warm-up 1, one timed run), the code before (46b0cef) and
# after (417f8c0) the two-step plan / host-marked positions, in one call: call I's cold 512K runs were slower
# than call C's (MInference default 3.57 -> 4.34 s, Star 4 + recall-0.99 3.23 -> 5.42 s).
LOG=run_j.log; source bench/gpu_env.sh
export STARSHARD_CACHE=/tmp/ss_cache
SMOL=$STARSHARD_CACHE/smollm2-135m-instruct-q4_1-f32
cat /tmp/smol/part_aa /tmp/smol/part_ab .smol3/part_ac > /tmp/smol/smol.gguf
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/smol/smol.gguf" | sha256sum -c || exit 1
T=120 step python3 -m starshard.checkpoints.convert --gguf /tmp/smol/smol.gguf --out "$SMOL" --dtype float32
T=30 step python3 bench/make_essay.py --out /tmp/essay.txt --sentences 40000
R99=bench/results/2026-11-25-h200-e2e/smollm2_minference_8k_recall99.json
P="launch/bench.py prefill --model $SMOL --prompt-file /tmp/essay.txt --dtype bfloat16 --decode-steps 0 --lengths 524288 --warmup 1 --repeats 1"
for code in old new; do
  D=.; [ $code = old ] && D=bench/old_46b0cef  # its launch/bench.py puts its own starshard first on sys.path
  T=90 step python3 $D/$P --cp-strategy dense --sparse minference --out $OUT/j_${code}_mi_default_512k.json
  T=90 step python3 $D/$P --cp-strategy star --num-blocks 4 --sparse minference --sparse-config $R99 --out $OUT/j_${code}_star4_recall99_512k.json
  T=90 step python3 $D/$P --cp-strategy dense --sparse minference --sparse-config $R99 --out $OUT/j_${code}_recall99_512k.json
done
grep -h "Traceback\|Error" "$LOG" | head -5
python3 - <<'PY' | tee -a "$LOG"
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/j_*.json")):
    r = json.load(open(f)); x = r["results"][0]
    print(os.path.basename(f), round(x["prefill_seconds"], 4), x["all_seconds"], x.get("sparse_report"))
PY
cd "$OUT" && tar czf run_j_results.tgz *.json && rm -f *.json
