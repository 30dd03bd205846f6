#!/bin/bash
# Issue 19's 128K target (--fp8 linear,kv >= 1.15x bf16, set on one H200) on whatever card the one-GPU kind gives,
# tree 9653403 + the test-harness change (no engine change since): Llama-3.1-8B shape, random weights and token ids
# (fine for dense speed), 128K prefill, warm-up 1, 2 timed runs each, order bf16, linear,kv, linear,kv, bf16.
# Then the Qwen3-30B-A3B decode step at 4K / 32K (issue 20's ratio on this card).
LOG=run_a.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
W="--cp-strategy dense --lengths 131072 --warmup 1 --repeats 2 --decode-steps 0"
T=150 step python3 launch/bench.py prefill $L8B $W --out "$OUT/bf16_1.json"
T=150 step python3 launch/bench.py prefill $L8B $W --fp8 linear,kv --out "$OUT/fp8_1.json"
T=150 step python3 launch/bench.py prefill $L8B $W --fp8 linear,kv --out "$OUT/fp8_2.json"
T=150 step python3 launch/bench.py prefill $L8B $W --out "$OUT/bf16_2.json"
M="launch/bench.py moe --random-weights qwen3-30b-a3b --skip-hf --prefill-lengths 4096 --repeats 1 --decode-contexts 4096,32768 --decode-steps 32"
T=120 step python3 $M --out "$OUT/moe.json"
grep -h "Traceback\|Error" "$LOG" | head
python3 - <<'PY' | tee -a "$LOG"
import json, os
O = os.environ["OUT"]
r = {n: json.load(open(f"{O}/{n}.json"))["results"][0] for n in ("bf16_1", "fp8_1", "fp8_2", "bf16_2")}
for n, x in r.items():
    print(n, round(x["prefill_seconds"], 3), [round(s, 3) for s in x["all_seconds"]])
b = (r["bf16_1"]["prefill_seconds"] + r["bf16_2"]["prefill_seconds"]) / 2
f = (r["fp8_1"]["prefill_seconds"] + r["fp8_2"]["prefill_seconds"]) / 2
print("linear,kv vs bf16 at 128K:", round(b / f, 4))
for d in json.load(open(f"{O}/moe.json"))["decode"]:
    print("moe", d["context"], round(1e3 * d["step_seconds"], 3), "ms", round(d["measured_over_bytes_bound"], 2), "x H200 bound")
PY
