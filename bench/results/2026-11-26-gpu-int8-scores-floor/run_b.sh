#!/bin/bash
# Call B, the committed floor (tree 069f1bd): the GPU tests of flash_fp8 / the int8-score dispatch, and
# `--fp8 linear,kv` vs `--fp8 linear,kv,attention` at 64K (now the same kernels) and 128K (8-bit scores), Llama-3.1-8B
# shape, random weights, warm-up 1, 2 runs.
LOG=run_b.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
T=300 step python3 -m pytest -q tests/test_flash_fp8.py -k "cuda or dispatch or decision" -p no:cacheprovider
W="--cp-strategy dense --warmup 1 --repeats 2 --decode-steps 0"
for L in 65536 131072; do
  T=120 step python3 launch/bench.py prefill $L8B $W --lengths $L --fp8 linear,kv --out "$OUT/lkv_${L}_b.json"
  T=120 step python3 launch/bench.py prefill $L8B $W --lengths $L --fp8 linear,kv,attention --out "$OUT/lkva_${L}_b.json"
done
grep -h "Traceback\|Error\|passed\|failed" "$LOG" | head
python3 - <<'PY' | tee -a "$LOG"
import json, os
O = os.environ["OUT"]
for L in (65536, 131072):
    a = json.load(open(f"{O}/lkv_{L}_b.json"))["results"][0]; b = json.load(open(f"{O}/lkva_{L}_b.json"))["results"][0]
    print(L, "linear,kv", round(a["prefill_seconds"], 4), "+attention", round(b["prefill_seconds"], 4),
          "gain", round(a["prefill_seconds"] / b["prefill_seconds"], 4))
PY
