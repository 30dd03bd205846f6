#!/bin/bash
# --fp8 experts on one GPU (Qwen3-30B-A3B shape, random weights: fine for speed; the outputs are compared with
# the bf16 ones, not judged for quality): the decode kernels on e4m3 experts vs bf16 (bench/fp8_experts_check.py),
# graph vs eager greedy tokens with --fp8 experts (bench/check_graph_decode.py), then the MoE bench (32K prefill,
# decode at 4K / 32K) in bf16, --fp8 experts, --fp8 linear,kv and --fp8 linear,kv,experts on the same machine.
LOG=run_a.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
T=120 step python3 bench/fp8_experts_check.py --out "$OUT/fp8_experts_check.json"
T=200 step python3 bench/check_graph_decode.py --random-weights qwen3-30b-a3b --prompt-len 4096 --steps 32 --fp8 experts
M="launch/bench.py moe --random-weights qwen3-30b-a3b --skip-hf --prefill-lengths 32768 --repeats 1 --decode-contexts 4096,32768 --decode-steps 32"
for f in none experts linear,kv linear,kv,experts; do
  T=200 step python3 $M --fp8 $f --out "$OUT/moe_${f//,/_}.json"
done
grep -h "Traceback\|Error" "$LOG" | head
python3 - <<'PY' | tee -a "$LOG"
import glob, json, os
for f in sorted(glob.glob(os.environ["OUT"] + "/moe_*.json")):
    d = json.load(open(f))
    p = d["prefill"][0]
    print(os.path.basename(f), "prefill 32K", round(p.get("prefill_seconds", float("nan")), 3), "s;",
          [(r["context"], round(1e3 * r["step_seconds"], 3), round(r["measured_over_bytes_bound"], 2)) for r in d["decode"]])
PY
