#!/bin/bash
# Device call B (one H200, warm after call A; carry .whl and .smol3/part_ab): keep the GGUF's second third in
# /tmp; the index build both ways at Llama-3.1-8B attention shapes (32 / 8 heads, d 128), 128K keys.
LOG=run_b.log; source bench/gpu_env.sh
mkdir -p /tmp/smol && cp .smol3/part_ab /tmp/smol/
T=75 step python3 bench/minference_index_bench.py --heads 32 --kv-heads 8 --head-dim 128 --out $OUT/minference_index_8b.json
grep -h "Traceback\|Error" "$LOG" | head -5
