#!/usr/bin/env bash
# One H200: the service benchmark on real weights, the embedded SmolLM2-135M-Instruct (its GGUF, carried
# in two halves over two warm calls: .smol/part_aa, then .smol/part_ab), bf16, random token ids.
# Call 1:  mkdir -p /tmp/smol && cp .smol/part_aa /tmp/smol/
# Call 2:
cat /tmp/smol/part_aa .smol/part_ab > /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
LOG=run.log; source bench/gpu_env.sh
T=400 step python3 launch/bench.py serve --model /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf --lengths 2048,8000 --concurrency 1,4,16 --decode-tokens 64 --cache-gib 20 --out "$OUT/serve_smollm2.json"
grep -h "Traceback\|Error" "$LOG" | head
