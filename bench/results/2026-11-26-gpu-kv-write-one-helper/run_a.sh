#!/bin/bash
# kernels/kv_write.py: the decode write's one-row helper folded into the prefill block's row-tile helper (one
# `_store_rows` for both). This tree vs .base (git archive of 8dd5dc2, the tree before): the decode writes of 32
# layers in a CUDA graph and the bytes against the torch path (bench/kv_write_bench.py), the prefill block write
# (bench/kv_block_write_check.py, 128K tokens), then Llama-3.1-8B decode (8K prompt, 128 CUDA-graph steps) in bf16
# and `--fp8 linear,kv`, base, new, base, new. Random weights: fine for decode speed.
LOG=run_a.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
P="launch/bench.py prefill $L8B --cp-strategy dense --lengths 8192 --warmup 1 --repeats 1 --decode-steps 128"
for tree in base new; do
  R=$PWD; [ $tree = base ] && R=$PWD/.base
  PYTHONPATH=/tmp/site:$R T=60 step python3 bench/kv_write_bench.py --out "$OUT/kv_write_$tree.json"
  PYTHONPATH=/tmp/site:$R T=60 step python3 bench/kv_block_write_check.py --out "$OUT/kv_block_$tree.json"
done
for i in 1 2; do
  for tree in base new; do
    R=$PWD; [ $tree = base ] && R=$PWD/.base
    PYTHONPATH=/tmp/site:$R T=120 step python3 $R/$P --out "$OUT/bf16_${tree}_$i.json"
    PYTHONPATH=/tmp/site:$R T=120 step python3 $R/$P --fp8 linear,kv --out "$OUT/fp8_${tree}_$i.json"
  done
done
grep -h "Traceback\|Error" "$LOG" | head
python3 - <<'PY' | tee -a "$LOG"
import glob, json, os
O = os.environ["OUT"]
for t in ("base", "new"):
    print("kv_write", t, json.dumps(json.load(open(f"{O}/kv_write_{t}.json")))[:400])
    print("kv_block", t, json.dumps(json.load(open(f"{O}/kv_block_{t}.json")))[:400])
for f in sorted(glob.glob(O + "/*_[12].json")):
    d = json.load(open(f))
    print(os.path.basename(f), [(x["length"], round(1e3 * x["decode"]["step_seconds"], 3)) for x in d["results"]])
PY
# one file back instead of twelve (the device returns eight at most)
python3 -c "
import glob, json, os
O = os.environ['OUT']
fs = sorted(glob.glob(O + '/*.json'))
json.dump({os.path.basename(f): json.load(open(f)) for f in fs}, open(O + '/all.json.tmp', 'w'), indent=1)
[os.remove(f) for f in fs]; os.rename(O + '/all.json.tmp', O + '/all.json')"
