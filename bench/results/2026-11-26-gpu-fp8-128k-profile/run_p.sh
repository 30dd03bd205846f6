#!/bin/bash
# Short prompts: the Llama-8B shape's prefill at 256-4K tokens, bf16 vs `--fp8 linear,kv` (order bf16, fp8, fp8,
# bf16; warm-up 2, 5 timed runs): where FP8's extra launches (activation quantization) could cost more than its
# GEMMs save. On an H200 first the 128K check.
LOG=run_p.log; source bench/gpu_env.sh
N=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$N" | tee -a "$LOG"
if [[ "$N" == *H200* ]]; then bash bench/results/2026-11-26-gpu-fp8-128k-profile/run_e.sh; fi
W="--cp-strategy dense --lengths 256,512,1024,2048,4096 --warmup 2 --repeats 5 --decode-steps 0"
T=150 step python3 launch/bench.py prefill $L8B $W --out "$OUT/short_bf16_1.json"
T=150 step python3 launch/bench.py prefill $L8B $W --fp8 linear,kv --out "$OUT/short_fp8_1.json"
T=150 step python3 launch/bench.py prefill $L8B $W --fp8 linear,kv --out "$OUT/short_fp8_2.json"
T=150 step python3 launch/bench.py prefill $L8B $W --out "$OUT/short_bf16_2.json"
python3 - <<'PY' | tee -a "$LOG"
import json, os
O = os.environ["OUT"]
r = {n: json.load(open(f"{O}/short_{n}.json"))["results"] for n in ("bf16_1", "fp8_1", "fp8_2", "bf16_2")}
for i, p in enumerate(r["bf16_1"]):
    x = {n: v[i]["prefill_seconds"] for n, v in r.items()}
    print(p["length"], {n: round(1e3 * t, 2) for n, t in x.items()}, "ms; linear,kv vs bf16:",
          round((x["bf16_1"] + x["bf16_2"]) / (x["fp8_1"] + x["fp8_2"]), 3))
PY
