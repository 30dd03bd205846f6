#!/bin/bash
# quantize_heads' two layouts (all heads in registers / loop over heads) by tile; the FP8 prefill's attention
# with v as a strided view vs contiguous (bench/fp8_attention_inputs.py); then the 128K check (order bf16,
# linear,kv, linear,kv, bf16).
LOG=run_d.log; source bench/gpu_env.sh
N=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$N" | tee -a "$LOG"
T=120 step python3 bench/fp8_quantize_heads.py --out "$OUT/quantize_heads_d.json"
T=200 step python3 bench/fp8_attention_inputs.py --rounds 2 --out "$OUT/attention_inputs.json"
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
    print(n, round(x["prefill_seconds"], 3), [round(s, 3) for s in x["all_seconds"]])
b = (r["bf16_1"]["prefill_seconds"] + r["bf16_2"]["prefill_seconds"]) / 2
f = (r["fp8_1"]["prefill_seconds"] + r["fp8_2"]["prefill_seconds"]) / 2
print("linear,kv vs bf16 at 128K:", round(b / f, 4))
PY
