#!/usr/bin/env bash
# One H200, after the Triton expert GEMVs for MoE decode (kernels/moe_decode.py): the kernels against
# grouped_mm and a float32 reference at decode sizes (bench/check_moe_decode.py), then the decode steps
# of the Qwen3-30B-A3B shape again (no transformers peer: the prefill rows of run.sh stand).
LOG=run_gemv.log; source bench/gpu_env.sh
T=120 step python3 bench/check_moe_decode.py --out "$OUT/moe_decode_kernels.json"
T=240 step python3 launch/bench.py moe --random-weights qwen3-30b-a3b --skip-hf --prefill-lengths 4096 --repeats 1 --decode-contexts 4096,32768 --decode-steps 32 --out "$OUT/moe_gemv.json"
grep -h "Traceback\|Error" "$LOG" | head
grep -h "gemv_us\|step_seconds\|measured_over_bytes_bound" "$LOG" | cut -c1-300
