#!/usr/bin/env bash
# One H200, 2026-11-24, after the review mends (shared e4m3 Triton helpers, apply_rope in kernels/rope.py,
# one CUDA-graph timer in starshard/benchmarks/common.py): the benches that use them still run and their
# byte-equality / error checks hold.
LOG=run_m.log; source bench/gpu_env.sh
T=60 step python3 bench/kv_write_bench.py --out "$OUT/kv_write_m.json"
T=60 step python3 bench/norm_bench.py
T=60 step python3 bench/rope_bench.py --out "$OUT/rope_m.json"
T=90 step python3 bench/fp8_prefill_fused.py --rows 8192 --out "$OUT/fp8_prefill_fused_m.json"
T=90 step python3 bench/check_moe_decode.py --out "$OUT/check_moe_decode_m.json"
T=120 step python3 -m pytest -q tests/test_fp8_prefix_attention.py
grep -h "Traceback\|Error\|passed\|failed\|same_bytes" "$LOG" | cut -c1-200 | head -20
