#!/bin/bash
# quantize_heads (wo's e4m3 rows straight from attention's [B, H, L, D] output) against the transposing copy +
# quantize_rows, then the 128K prefill end to end with it (order bf16, linear,kv, linear,kv, bf16) and a
# 2-layer fp8 profile.
LOG=run_c.log; source bench/gpu_env.sh
N=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$N" | tee -a "$LOG"
T=120 step python3 bench/fp8_quantize_heads.py --out "$OUT/quantize_heads.json"
W="--cp-strategy dense --lengths 131072 --warmup 1 --repeats 2 --decode-steps 0"
T=150 step python3 launch/bench.py prefill $L8B $W --out "$OUT/bf16_1.json"
T=150 step python3 launch/bench.py prefill $L8B $W --fp8 linear,kv --out "$OUT/fp8_1.json"
T=150 step python3 launch/bench.py prefill $L8B $W --fp8 linear,kv --out "$OUT/fp8_2.json"
T=150 step python3 launch/bench.py prefill $L8B $W --out "$OUT/bf16_2.json"
T=120 step python3 bench/profile_prefill.py --layers 2 --prompt-len 131072 --repeats 1 --fp8 linear,kv --out "$OUT/prof_fp8_c.json"
python3 - <<'PY' | tee -a "$LOG"
import json, os
O = os.environ["OUT"]
r = {n: json.load(open(f"{O}/{n}.json"))["results"][0] for n in ("bf16_1", "fp8_1", "fp8_2", "bf16_2")}
for n, x in r.items():
    print(n, round(x["prefill_seconds"], 3), [round(s, 3) for s in x["all_seconds"]])
b = (r["bf16_1"]["prefill_seconds"] + r["bf16_2"]["prefill_seconds"]) / 2
f = (r["fp8_1"]["prefill_seconds"] + r["fp8_2"]["prefill_seconds"]) / 2
print("linear,kv vs bf16 at 128K:", round(b / f, 4))
PY
