#!/bin/bash
# The device-tool command behind this directory (kind nvidia-h100-x1, no carry), from the repo root.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
set -o pipefail
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch,triton;print(torch.__version__,triton.__version__,torch.version.cuda)"
timeout 170 python3 -m pytest tests/test_flash_fp8.py -q -k cuda 2>&1 | tee $OUT/pytest_cuda.log | tail -15
timeout 380 python3 bench/fp8_prefill_attention.py --out $OUT/fp8_prefill_attention.json 2>&1 \
  | grep -v '^ \|^{\|^}' | tee $OUT/run.log
