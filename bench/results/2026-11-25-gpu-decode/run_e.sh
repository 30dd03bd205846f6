#!/bin/bash
# Device call E (the H200 of call D, warm; carry .whl), run inline as one command: the split-KV decode
# variants at 128K keys (default / even / even + tma / stream / merges), then one more 128K --fp8 linear,kv
# prefill + 128 decode steps of this tree (call D's new tree).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python3 bench/fp8_decode_split.py --quick --keys 131072 --out $OUT/fp8_decode_split_e.json > $OUT/run_e.log 2>&1
timeout 150 python3 launch/bench.py prefill --random-weights llama-3.1-8b --cp-strategy dense --lengths 131072 --warmup 1 \
  --repeats 1 --decode-steps 128 --fp8 linear,kv --out $OUT/l8b_new_linear_kv_e.json >> $OUT/run_e.log 2>&1
