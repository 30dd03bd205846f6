#!/bin/bash
# The Qwen3-30B-A3B shape's prefill (random weights) with the experts' and the dense SwiGLU through silu_mul's
# kernel (this tree) vs the session's start (.base = git archive 4b93d1a), alternating, bf16 and
# `--fp8 linear,kv,experts`. On an H200 first the Llama-8B 128K check (run_e).
LOG=run_j.log; source bench/gpu_env.sh
N=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$N" | tee -a "$LOG"
if [[ "$N" == *H200* ]]; then bash bench/results/2026-11-26-gpu-fp8-128k-profile/run_e.sh; fi
M="launch/bench.py moe --random-weights qwen3-30b-a3b --skip-hf --prefill-lengths 8192,32768 --repeats 3 --decode-contexts 4096 --decode-steps 8"
for i in 1 2; do
  T=150 step env PYTHONPATH=/tmp/site:$PWD/.base python3 .base/$M --out "$OUT/moe_base_$i.json"
  T=150 step python3 $M --out "$OUT/moe_new_$i.json"
done
T=150 step python3 $M --fp8 linear,kv,experts --out "$OUT/moe_new_fp8.json"
python3 - <<'PY' | tee -a "$LOG"
import json, os
O = os.environ["OUT"]
for n in ("moe_base_1", "moe_new_1", "moe_base_2", "moe_new_2", "moe_new_fp8"):
    d = json.load(open(f"{O}/{n}.json"))
    print(n, d.get("commit"), [(p.get("length"), round(p.get("prefill_seconds", p.get("seconds", 0)), 4)) for p in d.get("prefill", [])])
PY
