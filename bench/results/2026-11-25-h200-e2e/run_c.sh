#!/bin/bash
# Device call C (one H200, warm after B; carry .whl and .smol3/part_ac). SmolLM2-135M real weights, essay
# text, the tree after the index-build commit (Triton build by default, fewer host syncs): 128K prefill
# (warm-up 1, median of 3) dense / MInference default / searched / recall-0.98, the components at layer 15,
# then 512K one cold run each: dense, MInference default / searched / recall-0.98, Star 4 and APB 4 with
# MInference default inside (compare ../2026-11-23-h200-sparse-realweights/ and ../2026-11-25-h200-index/).
LOG=run_c.log; source bench/gpu_env.sh
export STARSHARD_CACHE=/tmp/ss_cache
SMOL=$STARSHARD_CACHE/smollm2-135m-instruct-q4_1-f32
cat /tmp/smol/part_aa /tmp/smol/part_ab .smol3/part_ac > /tmp/smol/smol.gguf
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/smol/smol.gguf" | sha256sum -c || exit 1
T=120 step python3 -m starshard.checkpoints.convert --gguf /tmp/smol/smol.gguf --out "$SMOL" --dtype float32
T=30 step python3 bench/make_essay.py --out /tmp/essay.txt --sentences 40000
R98=bench/results/2026-11-25-cpu-minference-search/smollm2_minference_8k_recall98.json
MI=bench/results/2026-11-23-h200-accuracy/smollm2_minference_8k.json
P="python3 launch/bench.py prefill --model $SMOL --prompt-file /tmp/essay.txt --dtype bfloat16 --decode-steps 0"
P128="$P --cp-strategy dense --lengths 131072 --warmup 1 --repeats 3"
T=90 step $P128 --out $OUT/dense_128k.json
T=90 step $P128 --sparse minference --out $OUT/mi_default_128k.json
T=90 step $P128 --sparse minference --sparse-config $MI --out $OUT/mi_searched_128k.json
T=90 step $P128 --sparse minference --sparse-config $R98 --out $OUT/mi_recall98_128k.json
T=120 step python3 bench/sparse_components.py --model $SMOL --length 131072 --layers 15 --no-flash --repeats 5 --warmup 2 --minference-config $R98 --skip-anchor --out $OUT/components_128k.json
P512="$P --lengths 524288 --warmup 0 --repeats 1"
T=100 step $P512 --cp-strategy dense --out $OUT/dense_512k.json
T=60 step $P512 --cp-strategy dense --sparse minference --out $OUT/mi_default_512k.json
T=60 step $P512 --cp-strategy dense --sparse minference --sparse-config $MI --out $OUT/mi_searched_512k.json
T=60 step $P512 --cp-strategy dense --sparse minference --sparse-config $R98 --out $OUT/mi_recall98_512k.json
T=60 step $P512 --cp-strategy star --num-blocks 4 --sparse minference --out $OUT/star4_mi_512k.json
T=60 step $P512 --cp-strategy apb --apb-hosts 4 --sparse minference --out $OUT/apb4_mi_512k.json
grep -h "Traceback\|Error" "$LOG" | head
python3 - <<'PY' | tee -a "$LOG"
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/*_*k.json")):
    r = json.load(open(f))
    for x in r.get("results", []):
        print(os.path.basename(f), x["length"], round(x["prefill_seconds"], 4), x.get("sparse_report"))
PY
cd "$OUT" && tar czf run_c_results.tgz *.json && rm -f *.json
