#!/bin/bash
# Call C: after the e4m3 expert tiles (GATE_UP_TILE_E4M3 / DOWN_TILE_E4M3 from call B's sweep) and the one-pass
# dequantize: the kernel check, graph vs eager tokens with --fp8 experts, and the MoE bench (32K prefill, decode at
# 4K / 32K) in bf16, --fp8 experts and --fp8 linear,kv,experts, alternated twice, on one machine.
LOG=run_c.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
T=120 step python3 bench/fp8_experts_check.py --out "$OUT/fp8_experts_check_c.json"
T=200 step python3 bench/check_graph_decode.py --random-weights qwen3-30b-a3b --prompt-len 4096 --steps 32 --fp8 linear,kv,experts
M="launch/bench.py moe --random-weights qwen3-30b-a3b --skip-hf --prefill-lengths 32768 --repeats 1 --decode-contexts 4096,32768 --decode-steps 32"
for i in 1 2; do
  for f in none experts linear,kv,experts; do
    T=200 step python3 $M --fp8 $f --out "$OUT/moe_c_${f//,/_}_$i.json"
  done
done
grep -h "Traceback\|Error" "$LOG" | head
python3 - <<'PY' | tee -a "$LOG"
import glob, json, os
O = os.environ["OUT"]
for f in sorted(glob.glob(O + "/moe_c_*.json")):
    d = json.load(open(f))
    p = d["prefill"][0]
    print(os.path.basename(f), "prefill 32K", round(p.get("prefill_seconds", float("nan")), 3), "s;",
          [(r["context"], round(1e3 * r["step_seconds"], 3), round(r["measured_over_bytes_bound"], 2)) for r in d["decode"]])
fs = sorted(glob.glob(O + "/moe_c_*.json"))
json.dump({os.path.basename(f): json.load(open(f)) for f in fs}, open(O + "/moe_c_all.json", "w"), indent=1)
[os.remove(f) for f in fs]
PY
