#!/bin/bash
# bf16 SwiGLU in one kernel (the engine's silu_mul now on every CUDA row count): tile sweep and the 128K
# prefill with torch's two passes vs the kernel (bench/bf16_swiglu_fused.py); then 8K and 128K prefill,
# bf16 and `--fp8 linear,kv` (order bf16, fp8, fp8, bf16). On an H200 first the 128K check (run_e).
LOG=run_h.log; source bench/gpu_env.sh
N=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$N" | tee -a "$LOG"
if [[ "$N" == *H200* ]]; then bash bench/results/2026-11-26-gpu-fp8-128k-profile/run_e.sh; fi
T=240 step python3 bench/bf16_swiglu_fused.py --rounds 2 --out "$OUT/bf16_swiglu_fused.json"
W="--cp-strategy dense --lengths 8192,131072 --warmup 1 --repeats 2 --decode-steps 0"
T=150 step python3 launch/bench.py prefill $L8B $W --out "$OUT/bf16_1.json"
T=150 step python3 launch/bench.py prefill $L8B $W --fp8 linear,kv --out "$OUT/fp8_1.json"
T=150 step python3 launch/bench.py prefill $L8B $W --fp8 linear,kv --out "$OUT/fp8_2.json"
T=150 step python3 launch/bench.py prefill $L8B $W --out "$OUT/bf16_2.json"
python3 - <<'PY' | tee -a "$LOG"
import json, os
O = os.environ["OUT"]
r = {n: json.load(open(f"{O}/{n}.json"))["results"] for n in ("bf16_1", "fp8_1", "fp8_2", "bf16_2")}
for i, L in enumerate((8192, 131072)):
    x = {n: v[i]["prefill_seconds"] for n, v in r.items()}
    print(L, {n: round(t, 4) for n, t in x.items()},
          "linear,kv vs bf16:", round((x["bf16_1"] + x["bf16_2"]) / (x["fp8_1"] + x["fp8_2"]), 4))
PY
