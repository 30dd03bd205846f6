#!/bin/bash
# Device call I (the H200 of call H, warm; carry .whl), inline: the final tree (55c9b04), three runs of the
# Llama-3.1-8B 128K --fp8 linear,kv prefill (warm-up 1) + 128 CUDA-graph decode steps.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/run_i.log
for i in 1 2 3; do
  timeout 150 python3 launch/bench.py prefill --random-weights llama-3.1-8b --cp-strategy dense --lengths 131072 --warmup 1 \
    --repeats 1 --decode-steps 128 --fp8 linear,kv --out $OUT/l8b_final_linear_kv_i$i.json >> $OUT/run_i.log 2>&1
done
