#!/bin/bash
# Call A: where the Vertical-Slash index build's time goes today (random bf16 q / k: the build's cost
# does not depend on the inputs' structure), SmolLM2 and Llama-8B shapes, 128K and 512K keys.
LOG=run_a.log; source bench/gpu_env.sh
step python3 bench/minference_index_bench.py --out $OUT/index_smollm2_128k.json --profile
step python3 bench/minference_index_bench.py --out $OUT/index_llama8b_128k.json --heads 32 --kv-heads 8 --head-dim 128
T=400 step python3 bench/minference_index_bench.py --out $OUT/index_smollm2_512k.json --length 524288
