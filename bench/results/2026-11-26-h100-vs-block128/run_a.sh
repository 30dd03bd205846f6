#!/bin/bash
# One device call (no carry), issue 18 item 3: the Vertical-Slash kernel on an index of 128-row blocks
# (bench/minference_kernel_variants.py --block128, never run on a GPU before) against the default
# 64-row index, and our Triton kernel running dense (A-shape covering every key) as the ceiling of the
# kernel family; structured synthetic q / k at 128K (kernel rates only, not end-to-end sparse speed),
# SmolLM2 shape (9 / 3 heads, d64) and Llama-8B shape (32 / 8, d128), bf16.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/run_a.log"
timeout 200 python3 bench/minference_kernel_variants.py --inputs structured --length 131072 \
  --patterns "vs:1000,6096;vs:200,1024;ashape:64,131072" --variants "default" --block128 \
  --repeats 5 --warmup 1 --budget-s 150 --out "$OUT/block128_smollm2_128k.json" 2>&1 | tee -a "$OUT/run_a.log"
timeout 200 python3 bench/minference_kernel_variants.py --shape llama8b --inputs structured --length 131072 \
  --patterns "vs:1000,6096;ashape:64,131072" --variants "default" --block128 \
  --repeats 3 --warmup 1 --budget-s 150 --out "$OUT/block128_llama8b_128k.json" 2>&1 | tee -a "$OUT/run_a.log"
