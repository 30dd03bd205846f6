#!/bin/bash
# Call G: --fp8 experts' prefill through FP8 grouped GEMMs (torch._scaled_grouped_mm on per-row quantized inputs):
# one layer at 32K tokens against the reference rounding on dequantized weights and against bf16
# (bench/fp8_experts_check.py --prefill-tokens), then the MoE bench's 32K prefill and 4K decode in bf16, --fp8
# experts and --fp8 linear,kv,experts, alternated twice, on one machine.
LOG=run_g.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
T=150 step python3 bench/fp8_experts_check.py --prefill-tokens 32768 --out "$OUT/fp8_experts_check_g.json"
M="launch/bench.py moe --random-weights qwen3-30b-a3b --skip-hf --prefill-lengths 32768 --repeats 2 --decode-contexts 4096 --decode-steps 32"
for i in 1 2; do
  for f in none experts linear,kv,experts; do
    T=200 step python3 $M --fp8 $f --out "$OUT/moe_g_${f//,/_}_$i.json"
  done
done
grep -h "Traceback\|Error" "$LOG" | head
python3 - <<'PY' | tee -a "$LOG"
import glob, json, os
O = os.environ["OUT"]
fs = sorted(glob.glob(O + "/moe_g_*.json"))
for f in fs:
    d = json.load(open(f))
    p = d["prefill"][0]
    print(os.path.basename(f), "prefill 32K", round(p.get("prefill_seconds", float("nan")), 3), p.get("all_seconds"), "s;",
          [(r["context"], round(1e3 * r["step_seconds"], 3)) for r in d["decode"]])
json.dump({os.path.basename(f): json.load(open(f)) for f in fs}, open(O + "/moe_g_all.json", "w"), indent=1)
[os.remove(f) for f in fs]
PY
