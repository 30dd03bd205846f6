#!/bin/bash
# Device call G (an H200; carry .whl), inline: where the Qwen3-30B-A3B decode step goes now (4K context,
# 5 CUDA-graph steps under the profiler, tree 6bc6fdb).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/profile_moe_g.log
timeout 300 python3 bench/profile_decode.py --random-weights qwen3-30b-a3b --prompt-len 4000 --steps 20 --sort cuda_time_total >> $OUT/profile_moe_g.log 2>&1
