#!/bin/bash
# The MoE decode's routed gate/up tile with the expert weights read from HBM (bench/moe_gate_up_tiles.py: each call
# routed to its own experts), then the best tile end to end: .alt = HEAD (ca5f487) with GATE_UP_TILE set to the
# probe's best, .base = HEAD; Qwen3-30B-A3B decode step 4K / 32K, base, alt, base, alt. Random weights.
LOG=run_a.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
T=200 step python3 bench/moe_gate_up_tiles.py --out "$OUT/tiles.json"
BEST=$(python3 -c "import json; b = json.load(open('$OUT/tiles.json'))['best_gate_up']; print(f\"dict(block_n={b['block_n']}, block_k={b['block_k']}, warps={b['warps']})\")")
echo "alt GATE_UP_TILE = $BEST" | tee -a "$LOG"
sed -i "s/^GATE_UP_TILE = dict(.*)$/GATE_UP_TILE = $BEST/" .alt/starshard/kernels/moe_decode.py
grep -n "^GATE_UP_TILE" .alt/starshard/kernels/moe_decode.py | tee -a "$LOG"
M="launch/bench.py moe --random-weights qwen3-30b-a3b --skip-hf --prefill-lengths 4096 --repeats 1 --decode-contexts 4096,32768 --decode-steps 32"
for run in base_1 alt_1 base_2 alt_2; do
  tree=${run%_*}; R=$PWD/.$tree
  PYTHONPATH=/tmp/site:$R T=150 step python3 $R/$M --out "$OUT/moe_$run.json"
done
grep -h "Traceback\|Error" "$LOG" | head
python3 - <<'PY' | tee -a "$LOG"
import glob, json, os
for f in sorted(glob.glob(os.environ["OUT"] + "/moe_*.json")):
    print(os.path.basename(f), [(r["context"], round(1e3 * r["step_seconds"], 3)) for r in json.load(open(f))["decode"]])
PY
