#!/bin/bash
# Call B: the default 16-bit GEMV tile by shape (kernels/gemv.py gemv_16bit_tile, this tree) vs .base (the tree
# before it, git archive of HEAD then): Qwen3-30B-A3B decode step at 4K / 32K and Llama-3.1-8B bf16 at 8K (prefill +
# 128 CUDA-graph decode steps), base, new, base, new on one machine. Random weights: fine for decode speed.
LOG=run_b.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
M="launch/bench.py moe --random-weights qwen3-30b-a3b --skip-hf --prefill-lengths 4096 --repeats 1 --decode-contexts 4096,32768 --decode-steps 32"
P="launch/bench.py prefill $L8B --cp-strategy dense --lengths 8192 --warmup 1 --repeats 1 --decode-steps 128"
for i in 1 2; do
  for tree in base new; do
    R=$PWD; [ $tree = base ] && R=$PWD/.base
    PYTHONPATH=/tmp/site:$R T=150 step python3 $R/$M --out "$OUT/moe_${tree}_$i.json"
    PYTHONPATH=/tmp/site:$R T=150 step python3 $R/$P --out "$OUT/l8b_${tree}_$i.json"
  done
done
grep -h "Traceback\|Error" "$LOG" | head
python3 - <<'PY' | tee -a "$LOG"
import glob, json, os
for f in sorted(glob.glob(os.environ["OUT"] + "/*_[12].json")):
    d = json.load(open(f)); n = os.path.basename(f)
    if n.startswith("moe"):
        print(n, [(r["context"], round(1e3 * r["step_seconds"], 3)) for r in d["decode"]])
    else:
        print(n, [(x["length"], round(1e3 * x["decode"]["step_seconds"], 3)) for x in d["results"]])
PY
