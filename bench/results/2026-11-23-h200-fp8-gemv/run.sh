#!/usr/bin/env bash
# One H200: the FP8 weight-only GEMV for decode (kernels/fp8.py, up to 4 rows), its tiles swept on the
# Llama-3.1-8B projections against bf16 cuBLAS (bench/fp8_gemv_tune.py), then decode at 128K with
# --fp8 linear,kv and bf16 (Llama-3.1-8B shape, random bf16 weights, one process, CUDA graph).
LOG=run.log; source bench/gpu_env.sh
[ "${SKIP_TUNE:-0}" = 1 ] || T=120 step python3 bench/fp8_gemv_tune.py --out "$OUT/fp8_gemv_tune.json"
[ "${TUNE_ONLY:-0}" = 1 ] && exit 0
P="launch/bench.py prefill $L8B --cp-strategy dense --warmup 0 --repeats 1 --decode-steps 16 --lengths 131072"
T=150 step python3 $P --fp8 linear,kv --out "$OUT/decode_linear_kv.json"
T=150 step python3 $P --out "$OUT/decode_none.json"
grep -h "Traceback\|Error" "$LOG" | head
grep -h "default\|step_seconds" "$LOG" | cut -c1-400
