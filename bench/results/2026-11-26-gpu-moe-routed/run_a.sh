#!/bin/bash
# Call A: MoE decode with the routing inside the gate/up launch (kernels/moe_decode.py routed_gate_up).
# 1) bench/tune_moe_decode.py: tiles, separate vs fused launches at the Qwen3-30B-A3B shape (one token, CUDA
#    graph), bit-equality of the fused outputs; 2) launch/bench.py moe (Qwen3-30B-A3B shape, random bf16
#    weights: fine for decode speed), .base (c3525b2) then this tree, same machine.
LOG=run_a.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
T=150 step python3 bench/tune_moe_decode.py --out "$OUT/tune_moe_decode.json"
M="launch/bench.py moe --random-weights qwen3-30b-a3b --skip-hf --prefill-lengths 4096 --repeats 1 --decode-contexts 4096,32768 --decode-steps 32"
PYTHONPATH=/tmp/site:$PWD/.base T=200 step python3 .base/$M --out "$OUT/moe_base.json"
T=200 step python3 $M --out "$OUT/moe_new.json"
grep -h "Traceback\|Error" "$LOG" | head
grep -h "decode_ms\|bytes_bound" "$OUT"/moe_*.json | head -20
