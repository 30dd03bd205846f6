#!/bin/bash
# Device call I (one H200): the MInference Vertical-Slash index build, torch ops vs the new Triton launches
# (kernels/minference/estimate.py, columns.py), SmolLM2 shapes at 128K keys (bench/minference_index_bench.py).
LOG=run_i.log; source bench/gpu_env.sh
T=75 step python3 bench/minference_index_bench.py --out $OUT/minference_index.json
grep -h "Traceback\|Error" "$LOG" | head -5
