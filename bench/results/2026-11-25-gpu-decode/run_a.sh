#!/bin/bash
# One device call (carry .whl and .old_head = `git archive 7f7a98c starshard launch`, the tree before this
# session's decode changes): (1) the decode small kernels (silu-mul, argmax) eager torch vs one launch;
# (2) Llama-3.1-8B shape, random bf16 weights, 128K prefill + 64 CUDA-graph decode steps, bf16 and
# --fp8 linear,kv, before (.old_head) and after (this tree), same machine.
LOG=run_a.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
T=120 step python3 bench/decode_small_kernels.py --out "$OUT/decode_small_kernels.json"
P="launch/bench.py prefill $L8B --cp-strategy dense --lengths 131072 --warmup 0 --repeats 1 --decode-steps 64"
for f in linear,kv none; do
  for tree in new old; do
    dir=.; [ $tree = old ] && dir=.old_head
    (cd $dir && export PYTHONPATH=/tmp/site:$PWD && T=150 step python3 $P --fp8 $f --out "$OUT/l8b_${tree}_${f/,/_}.json")
  done
done
grep -h "Traceback\|Error" "$LOG" | head -5
python3 - <<'PY' | tee -a "$LOG"
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/l8b_*.json")):
    x = json.load(open(f))["results"][0]
    print(os.path.basename(f), "prefill", round(x["prefill_seconds"], 3), "decode ms", round(1e3 * x["decode"]["step_seconds"], 3))
PY
