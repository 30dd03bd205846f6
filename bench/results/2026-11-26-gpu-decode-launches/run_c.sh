#!/bin/bash
# Call C: the split count one wave at most (this tree: 16-bit caches one program per multiprocessor, e4m3 two,
# the chunk from the device-side key count) vs .base (6fa28da). 1) bench/decode_splits.py; 2) greedy tokens,
# eager vs CUDA graphs (the graphs read the key count on the device); 3) Qwen3-30B-A3B decode 4K / 32K and
# Llama-3.1-8B 128K prefill + 128 graph decode steps, bf16 and --fp8 linear,kv, .base and this tree on one
# machine. Random weights: fine for decode speed.
LOG=run_c.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
T=120 step python3 bench/decode_splits.py --out "$OUT/decode_splits_c.json" --splits 16,32,64
T=200 step python3 bench/check_graph_decode.py --random-weights llama-3.1-8b --prompt-len 8000 --steps 32
M="launch/bench.py moe --random-weights qwen3-30b-a3b --skip-hf --prefill-lengths 4096 --repeats 1 --decode-contexts 4096,32768 --decode-steps 32"
P="launch/bench.py prefill $L8B --cp-strategy dense --lengths 131072 --warmup 0 --repeats 1 --decode-steps 128"
for tree in base new; do
  R=$PWD; [ $tree = base ] && R=$PWD/.base
  PYTHONPATH=/tmp/site:$R T=150 step python3 $R/$M --out "$OUT/moe_${tree}_c.json"
  PYTHONPATH=/tmp/site:$R T=150 step python3 $R/$P --out "$OUT/l8b_bf16_${tree}_c.json"
  PYTHONPATH=/tmp/site:$R T=150 step python3 $R/$P --fp8 linear,kv --out "$OUT/l8b_fp8_${tree}_c.json"
done
grep -h "Traceback\|Error" "$LOG" | head
python3 - <<'PY' | tee -a "$LOG"
import glob, json, os
for f in sorted(glob.glob(os.environ["OUT"] + "/*_c.json")):
    d = json.load(open(f)); n = os.path.basename(f)
    if n.startswith("moe"):
        print(n, [(r["context"], round(1e3 * r["step_seconds"], 3)) for r in d["decode"]])
    elif n.startswith("l8b"):
        print(n, [(x["length"], round(x["prefill_seconds"], 3), x.get("decode")) for x in d["results"]])
PY
