#!/bin/bash
# One device call (kind nvidia-h200 asked; carry .whl and .old_head = `git archive 7f7a98c starshard launch`):
# (1) the decode small kernels, now with the FP8 GEMV adding the block's residual in its epilogue;
# (2) Llama-3.1-8B shape, random bf16 weights, 128K prefill (warm-up 1) + 64 CUDA-graph decode steps,
# --fp8 linear,kv and bf16, old tree (.old_head) then this tree; (3) on an H200 only, the split-KV decode
# variants (bench/fp8_decode_split.py --quick: is the `tma` option faster there?).
LOG=run_c.log; source bench/gpu_env.sh
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$GPU" | tee -a "$LOG"
T=120 step python3 bench/decode_small_kernels.py --out "$OUT/decode_small_kernels_c.json"
P="launch/bench.py prefill $L8B --cp-strategy dense --lengths 131072 --warmup 1 --repeats 1 --decode-steps 64"
for f in linear,kv none; do
  for tree in old new; do
    dir=.; [ $tree = old ] && dir=.old_head
    (cd $dir && export PYTHONPATH=/tmp/site:$PWD && T=150 step python3 $P --fp8 $f --out "$OUT/l8b_${tree}_${f/,/_}_c.json")
  done
done
case "$GPU" in *H200*) T=150 step python3 bench/fp8_decode_split.py --quick --keys 131072 --out "$OUT/fp8_decode_split_c.json";; esac
grep -h "Traceback\|Error" "$LOG" | head -5
python3 - <<'PY' | tee -a "$LOG"
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/l8b_*.json")):
    x = json.load(open(f))["results"][0]
    print(os.path.basename(f), "prefill", round(x["prefill_seconds"], 3), "decode ms", round(1e3 * x["decode"]["step_seconds"], 3))
r = json.load(open(os.environ["OUT"] + "/decode_small_kernels_c.json"))
for x in r["gemv_residual"] + r["argmax"]:
    print(x)
PY
