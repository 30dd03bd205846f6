#!/bin/bash
# Device call B (a fresh machine after A; carry .whl and .old_head): (1) the small kernels again after the
# argmax became two launches (chunks, then the chunks' winners); (2) the 128K `--fp8 linear,kv` pair again
# with a warm-up prefill (call A's first run of each tree paid Triton's compilation: the new tree, run first,
# compiled what the old tree then found cached), old tree first; (3) Qwen3-30B-A3B shape MoE decode at
# 4K / 32K context (CUDA graph), before and after.
LOG=run_b.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
T=120 step python3 bench/decode_small_kernels.py --out "$OUT/decode_small_kernels_b.json"
P="launch/bench.py prefill $L8B --cp-strategy dense --lengths 131072 --warmup 1 --repeats 1 --decode-steps 64 --fp8 linear,kv"
M="launch/bench.py moe --random-weights qwen3-30b-a3b --skip-hf --prefill-lengths 4096 --repeats 1 --decode-contexts 4096,32768 --decode-steps 32"
for tree in old new; do
  dir=.; [ $tree = old ] && dir=.old_head
  (cd $dir && export PYTHONPATH=/tmp/site:$PWD && T=150 step python3 $P --out "$OUT/l8b_${tree}_linear_kv_b.json")
done
for tree in old new; do
  dir=.; [ $tree = old ] && dir=.old_head
  (cd $dir && export PYTHONPATH=/tmp/site:$PWD && T=150 step python3 $M --out "$OUT/moe_${tree}.json")
done
grep -h "Traceback\|Error" "$LOG" | head -5
python3 - <<'PY' | tee -a "$LOG"
import json, glob, os
for f in sorted(glob.glob(os.environ["OUT"] + "/l8b_*.json")):
    x = json.load(open(f))["results"][0]
    print(os.path.basename(f), "prefill", round(x["prefill_seconds"], 3), "decode ms", round(1e3 * x["decode"]["step_seconds"], 3))
for f in sorted(glob.glob(os.environ["OUT"] + "/moe_*.json")):
    for r in json.load(open(f))["decode"]:
        print(os.path.basename(f), r["context"], "ms", round(1e3 * r["step_seconds"], 3))
r = json.load(open(os.environ["OUT"] + "/decode_small_kernels_b.json"))
for x in r["argmax"]:
    print("argmax", x)
PY
