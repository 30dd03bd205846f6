#!/usr/bin/env bash
# CPU (this session's 2-core machine), the embedded SmolLM2-135M-Instruct in float32: the harness at 1K and
# 2K tokens, 6 tasks x 2 depths x 2 samples (48 prompts per run), without FP8 and with the --fp8 reference
# paths (kernels/fp8.py: e4m3 weights with per-channel scales, activations rounded per row above 64 rows as
# the GPU's FP8 GEMM does; e4m3 KV with per-(head, token) scales). Each run took 25-50 min here.
E="python launch/eval.py --lengths 1024,2048 --depths 0.25,0.75 --samples-per-cell 2 --tasks passkey,niah_essay,niah_number,multikey,multiquery,variable_tracking --device cpu --no-progress"
R=bench/results/2026-11-23-cpu-fp8-accuracy
OMP_NUM_THREADS=1 $E --fp8 none --strategy-name dense --out $R/dense
OMP_NUM_THREADS=1 $E --fp8 linear --strategy-name fp8-linear --out $R/fp8-linear
OMP_NUM_THREADS=1 $E --fp8 linear,kv --strategy-name fp8-linear-kv --out $R/fp8-linear-kv
python launch/eval.py --compare $R/dense $R/fp8-linear $R/fp8-linear-kv --out $R
