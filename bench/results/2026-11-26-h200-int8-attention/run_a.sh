#!/bin/bash
# Device call A (kind nvidia-h200, carry .whl): `--fp8 attention` = flash_fp8 variant s (int8 Q, int8 K
# minus its mean, P @ V in bf16). 1) compiled kernels against the float64 blockwise reference; 2) the
# kernel against cuDNN bf16 at 32K / 128K (Llama-8B heads, random inputs: speed does not depend on them);
# 3) end to end at 128K, Llama-3.1-8B shape, random weights: bf16, --fp8 linear,kv, --fp8 linear,kv,attention.
LOG=run_a.log
source bench/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
T=150 step python3 -m pytest tests/test_flash_fp8.py -q -k cuda
T=150 step python3 bench/fp8_prefill_attention.py --lengths 32768,131072 --variants a,s --sweep-length 32768 \
  --configs "128,128,8,3:tma 128,64,8,3:tma 128,128,8,2:tma 64,128,4,3:tma" --repeats 5 --out $OUT/attention.json
for fp8 in none linear,kv linear,kv,attention; do
  T=100 step python3 launch/bench.py prefill $L8B --cp-strategy dense --lengths 131072 --warmup 1 --repeats 1 \
    --decode-steps 0 --fp8 $fp8 --out $OUT/prefill_128k_${fp8//,/_}.json
done
grep "^|" "$LOG" | tail -8
