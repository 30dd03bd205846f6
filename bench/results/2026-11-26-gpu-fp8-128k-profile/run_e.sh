#!/bin/bash
# The 128K check (issue 19's target is set on one H200) on the first card of whatever host came, only if
# it is an H200: order bf16, linear,kv, linear,kv, bf16, each warm-up 1 + 2 timed runs.
LOG=run_e.log; source bench/gpu_env.sh
export CUDA_VISIBLE_DEVICES=0
N=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$N" | tee -a "$LOG"
[[ "$N" == *H200* || "${FORCE:-0}" == 1 ]] || exit 0
W="--cp-strategy dense --lengths 131072 --warmup 1 --repeats 2 --decode-steps 0"
T=150 step python3 launch/bench.py prefill $L8B $W --out "$OUT/bf16_1.json"
T=150 step python3 launch/bench.py prefill $L8B $W --fp8 linear,kv --out "$OUT/fp8_1.json"
T=150 step python3 launch/bench.py prefill $L8B $W --fp8 linear,kv --out "$OUT/fp8_2.json"
T=150 step python3 launch/bench.py prefill $L8B $W --out "$OUT/bf16_2.json"
python3 - <<'PY' | tee -a "$LOG"
import json, os
O = os.environ["OUT"]
r = {n: json.load(open(f"{O}/{n}.json"))["results"][0] for n in ("bf16_1", "fp8_1", "fp8_2", "bf16_2")}
for n, x in r.items():
    print(n, x["device"] if "device" in x else "", round(x["prefill_seconds"], 3), [round(s, 3) for s in x["all_seconds"]])
b = (r["bf16_1"]["prefill_seconds"] + r["bf16_2"]["prefill_seconds"]) / 2
f = (r["fp8_1"]["prefill_seconds"] + r["fp8_2"]["prefill_seconds"]) / 2
print("linear,kv vs bf16 at 128K:", round(b / f, 4))
PY
