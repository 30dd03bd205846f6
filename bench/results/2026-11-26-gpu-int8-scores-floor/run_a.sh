#!/bin/bash
# Where `--fp8 attention` (8-bit prefill scores, flash_fp8 variant s) starts to pay: the kernel (with its pre-pass)
# against cuDNN bf16 at 16K-128K in the model's layout, then end to end (Llama-3.1-8B shape, random weights and token
# ids: fine for dense speed) `--fp8 linear,kv` vs `--fp8 linear,kv,attention` at 64K and 96K, warm-up 1, 2 runs each.
LOG=run_a.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
T=240 step python3 bench/fp8_prefill_attention.py --layout model --variants s --sweep-length 0 \
  --lengths 16384,32768,49152,65536,98304,131072 --repeats 5 --out "$OUT/kernel_s.json"
W="--cp-strategy dense --warmup 1 --repeats 2 --decode-steps 0"
for L in 65536 98304; do
  T=120 step python3 launch/bench.py prefill $L8B $W --lengths $L --fp8 linear,kv --out "$OUT/lkv_$L.json"
  T=120 step python3 launch/bench.py prefill $L8B $W --lengths $L --fp8 linear,kv,attention --out "$OUT/lkva_$L.json"
done
grep -h "Traceback\|Error" "$LOG" | head
python3 - <<'PY' | tee -a "$LOG"
import json, os
O = os.environ["OUT"]
for r in json.load(open(f"{O}/kernel_s.json"))["rows"]:
    print(r["length"], "cudnn", round(r["cudnn_bf16"]["total_s"], 5), "s total", round(r["fp8_s"]["total_s"], 5),
          "speedup", round(r["fp8_s"]["speedup_vs_cudnn"], 3))
for L in (65536, 98304):
    a = json.load(open(f"{O}/lkv_{L}.json"))["results"][0]; b = json.load(open(f"{O}/lkva_{L}.json"))["results"][0]
    print(L, "linear,kv", round(a["prefill_seconds"], 4), a["all_seconds"], "+attention", round(b["prefill_seconds"], 4), b["all_seconds"],
          "gain", round(a["prefill_seconds"] / b["prefill_seconds"], 4))
PY
