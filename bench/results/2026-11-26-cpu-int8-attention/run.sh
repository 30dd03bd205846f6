#!/bin/bash
# CPU (2 cores, float32), the embedded SmolLM2-135M-Instruct: harness accuracy of `--fp8 attention`
# (8-bit prefill scores: int8 q per 128 rows, int8 K minus its mean per 128 keys; on the CPU the
# dequantize-then-attend reference path) against the same run without it. 150 prompts: 1K-4K,
# 5 depths x 2, 5 tasks, seed 7 (the prompts of 2026-11-25-cpu-apb-sparse-accuracy).
set -u
OUT=${OUT:-/tmp/acc19}; mkdir -p "$OUT"
E="--lengths 1024,2048,4096 --depths 0.1,0.3,0.5,0.7,0.9 --samples-per-cell 2 --seed 7 --tasks passkey,niah_essay,multikey,multiquery,variable_tracking --device cpu --dtype float32 --no-progress"
OMP_NUM_THREADS=1 python launch/eval.py $E --strategy-name dense --out "$OUT/dense" > "$OUT/dense.log" 2>&1 &
OMP_NUM_THREADS=1 python launch/eval.py $E --fp8 attention --strategy-name int8-scores --out "$OUT/int8" > "$OUT/int8.log" 2>&1
wait
python launch/eval.py --compare "$OUT/dense" "$OUT/int8" --out "$OUT/cmp"
