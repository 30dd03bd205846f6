#!/bin/bash
# Call B (warm after run_a.sh; no carry; ran as this command line): the MInference kernel at head dim 128
# on 64-row blocks with 4 warps and other stages / variants, against the built-in 8,2 (run_a's 0.29).
set -u; export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD; OUT=${OUT:-/tmp/out}
timeout 250 python3 bench/minference_kernel_variants.py --shape llama8b --inputs structured --length 131072 --patterns "vs:1000,6096;vs:200,1024;ashape:64,131072" --variants "default:4,2;default:4,3;default:4,1;flat:4,2;wide:4,2;default:8,2" --repeats 3 --warmup 1 --budget-s 200 --out "$OUT/d128_64row_sweep.json" 2>&1 | tee "$OUT/run_b.log"
