#!/bin/bash
# Device call I (one H200, after two run_f.sh calls; carry .whl and .smol3/part_ac): the tree with the two-step
# fallback plan and host-marked positions (417f8c0). SmolLM2 real weights, essay text: profiles of the sparse
# 128K prefill, prefill seconds at 128K (warm-up 1, median of 3) and 512K (one cold run).
LOG=run_i.log; source bench/gpu_env.sh
export STARSHARD_CACHE=/tmp/ss_cache
SMOL=$STARSHARD_CACHE/smollm2-135m-instruct-q4_1-f32
cat /tmp/smol/part_aa /tmp/smol/part_ab .smol3/part_ac > /tmp/smol/smol.gguf
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/smol/smol.gguf" | sha256sum -c || exit 1
T=120 step python3 -m starshard.checkpoints.convert --gguf /tmp/smol/smol.gguf --out "$SMOL" --dtype float32
T=30 step python3 bench/make_essay.py --out /tmp/essay.txt --sentences 40000
R=bench/results/2026-11-25-h200-e2e
R98=bench/results/2026-11-25-cpu-minference-search/smollm2_minference_8k_recall98.json
R99=$R/smollm2_minference_8k_recall99.json
PP="python3 bench/profile_prefill.py --model $SMOL --prompt-file /tmp/essay.txt --prompt-len 131072 --repeats 2"
T=90 step $PP --sparse minference --sparse-config $R98 --out $OUT/i_prof_recall98.json
T=90 step $PP --sparse minference --sparse-config $R99 --out $OUT/i_prof_recall99.json
P="python3 launch/bench.py prefill --model $SMOL --prompt-file /tmp/essay.txt --dtype bfloat16 --decode-steps 0"
P128="$P --cp-strategy dense --lengths 131072 --warmup 1 --repeats 3"
T=90 step $P128 --out $OUT/i_dense_128k.json
T=90 step $P128 --sparse minference --out $OUT/i_mi_default_128k.json
T=90 step $P128 --sparse minference --sparse-config $R98 --out $OUT/i_mi_recall98_128k.json
T=90 step $P128 --sparse minference --sparse-config $R99 --out $OUT/i_mi_recall99_128k.json
P512="$P --lengths 524288 --warmup 0 --repeats 1"
T=60 step $P512 --cp-strategy dense --sparse minference --out $OUT/i_mi_default_512k.json
T=60 step $P512 --cp-strategy dense --sparse minference --sparse-config $R99 --out $OUT/i_mi_recall99_512k.json
T=60 step $P512 --cp-strategy star --num-blocks 4 --sparse minference --sparse-config $R99 --out $OUT/i_star4_recall99_512k.json
T=60 step $P512 --cp-strategy apb --apb-hosts 4 --sparse minference --sparse-config $R99 --out $OUT/i_apb4_recall99_512k.json
grep -h "Traceback\|Error" "$LOG" | head -5
grep -h -A8 "^prefill 131072" "$LOG"
python3 - <<'PY' | tee -a "$LOG"
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/i_*k.json")):
    r = json.load(open(f)); x = r["results"][0]
    print(os.path.basename(f), x["length"], round(x["prefill_seconds"], 4), x["all_seconds"], x.get("sparse_report"))
PY
cd "$OUT" && tar czf run_i_results.tgz *.json && rm -f *.json
