#!/bin/bash
# run_k again after the FP8 grouped GEMMs took fast accumulation (engine/moe.py): one MoE layer's experts by token
# count, and the Qwen3-30B-A3B prefill at 2K / 8K / 32K with each --fp8 part. On an H200 first the 128K check.
LOG=run_n.log; source bench/gpu_env.sh
N=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$N" | tee -a "$LOG"
if [[ "$N" == *H200* ]]; then bash bench/results/2026-11-26-gpu-fp8-128k-profile/run_e.sh; fi
T=150 step python3 bench/fp8_experts_check.py --prefill-tokens 512,2048,4096,8192,16384,32768 --out "$OUT/experts_by_tokens.json"
M="launch/bench.py moe --random-weights qwen3-30b-a3b --skip-hf --prefill-lengths 2048,8192,32768 --repeats 3 --decode-contexts 4096 --decode-steps 4"
T=150 step python3 $M --out "$OUT/moe_none.json"
for f in linear kv experts linear,kv,experts; do T=150 step python3 $M --fp8 $f --out "$OUT/moe_${f//,/_}.json"; done
python3 - <<'PY' | tee -a "$LOG"
import json, os
O = os.environ["OUT"]
for r in json.load(open(f"{O}/experts_by_tokens.json"))["prefill"]:
    print("experts", r["tokens"], "fp8", round(r["fp8_ms"], 3), "bf16", round(r["bf16_ms"], 3), "ref", round(r["reference_ms"], 3))
for n in ("none", "linear", "kv", "experts", "linear_kv_experts"):
    d = json.load(open(f"{O}/moe_{n}.json"))
    print(n, [(p["length"], round(p["prefill_seconds"], 4)) for p in d["prefill"]])
PY
