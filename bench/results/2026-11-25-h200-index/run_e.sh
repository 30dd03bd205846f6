#!/bin/bash
# Device call E (one H200): the index build's Triton launches judged by the float64 estimate (random q / k
# give near-flat rows, where bf16 and float32 products order near-ties differently; float32 inputs
# should pick identically) and profiled kernel by kernel, SmolLM2 shapes at 128K keys.
LOG=run_e.log; source bench/gpu_env.sh
T=120 step python3 bench/minference_index_bench.py --profile --out $OUT/minference_index_prof.json
T=90 step python3 bench/minference_index_bench.py --dtype float32 --out $OUT/minference_index_fp32.json
grep -h "Traceback\|Error" "$LOG" | head -5
