#!/bin/bash
# Call A: e4m3 GEMM with / without use_fast_accum, cuDNN attention layouts at 128K (bench/fp8_fast_accum.py)
LOG=run_a.log
source bench/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv | tee -a "$LOG"
T=400 step python3 bench/fp8_fast_accum.py --out "$OUT/fast_accum_a.json"
tail -30 "$LOG"
