#!/bin/bash
# Device call A (one H200, carry .whl and .smol3/part_aa): the SmolLM2 GGUF travels in thirds (the tracked tree
# is ~15 MB, a call carries 64 MiB): keep the first in /tmp for call C. Check the MInference index build's
# Triton launches against the torch ops (agreement and milliseconds), SmolLM2 shapes at 128K keys: the
# script written as ../2026-11-25-h200/run_i.sh.
LOG=run_a.log; source bench/gpu_env.sh
mkdir -p /tmp/smol && cp .smol3/part_aa /tmp/smol/
T=75 step python3 bench/minference_index_bench.py --out $OUT/minference_index.json
grep -h "Traceback\|Error" "$LOG" | head -5
