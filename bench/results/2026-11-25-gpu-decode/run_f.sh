#!/bin/bash
# Device call F (the same H200, warm; carry .whl): kernels/decode.py with _FP8_OPTIONS "even" on (the
# unmasked e4m3 split kernel, 92.7 vs 93.8 us per layer in call E), two runs of the 128K --fp8 linear,kv
# prefill + 128 decode steps.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
for i in 1 2; do
  timeout 150 python3 launch/bench.py prefill --random-weights llama-3.1-8b --cp-strategy dense --lengths 131072 --warmup 1 \
    --repeats 1 --decode-steps 128 --fp8 linear,kv --out $OUT/l8b_even_linear_kv_f$i.json > $OUT/run_f$i.log 2>&1
done
