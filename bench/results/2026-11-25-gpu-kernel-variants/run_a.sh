#!/bin/bash
# One device call (no carry): the MInference kernel variants on structured synthetic q / k at 128K
# (SmolLM2 shape: 9 / 3 heads, head dim 64; bf16), and the dense tail-block split of
# attention.causal_attention_at against the masked kernel (random inputs).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/run_a.log"
timeout 60 python3 bench/tail_attention.py --out "$OUT/tail_attention.json" 2>&1 | tee -a "$OUT/run_a.log"
timeout 170 python3 bench/minference_kernel_variants.py --inputs structured --length 131072 \
  --patterns "vs:1000,6096;vs:200,1024" --variants "default;pair:8,2;pair+flat:8,2;flat;wide;default:4,3" \
  --repeats 5 --warmup 1 --budget-s 110 --out "$OUT/kernel_variants_smollm2_128k.json" 2>&1 | tee -a "$OUT/run_a.log"
