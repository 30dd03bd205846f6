#!/usr/bin/env bash
# One H200, 2026-11-24, fourth call: the MoE down kernel with its k experts unrolled (tl.static_range):
# (1) bench/tune_moe_decode.py over down tiles; (2) the fastest down tile written into the device copy of
# kernels/moe_decode.py (DOWN_TILE; the commit carries the same value); (3) one layer before / after
# (bench/moe_decode_fused.py); (4) the Qwen3-30B-A3B-shaped decode step, 4K and 32K context.
LOG=run_d.log; source bench/gpu_env.sh
T=150 step python3 bench/tune_moe_decode.py --out "$OUT/tune_moe_decode_d.json"
python3 - "$OUT/tune_moe_decode_d.json" <<'PY' | tee -a "$LOG"
import json, re, sys
rows = [r for r in json.load(open(sys.argv[1]))["rows"] if r["kernel"] == "down" and "us" in r]
b = min(rows, key=lambda r: r["us"])
p = "starshard/kernels/moe_decode.py"
s = open(p).read()
s = re.sub(r"DOWN_TILE = dict\([^)]*\)", f"DOWN_TILE = dict(block_n={b['block_n']}, block_k={b['block_k']}, warps={b['warps']})", s)
open(p, "w").write(s)
print("DOWN_TILE set to", b)
PY
T=90 step python3 bench/moe_decode_fused.py --out "$OUT/moe_decode_fused_d.json"
T=240 step python3 launch/bench.py moe --random-weights qwen3-30b-a3b --skip-hf --prefill-lengths 4096 --repeats 1 --decode-contexts 4096,32768 --decode-steps 32 --out "$OUT/moe_d.json"
grep -h "Traceback\|Error" "$LOG" | head
grep -h "step_seconds\|measured_over_bytes_bound" "$LOG" | cut -c1-200
