#!/bin/bash
# Call C (warm after run_b.sh; no carry; ran as this command line): flat vs per-run loops and 1-3 stages at
# 4 warps, head dim 128, with an A-shape and a Block-Sparse pattern too.
set -u; export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD; OUT=${OUT:-/tmp/out}
timeout 250 python3 bench/minference_kernel_variants.py --shape llama8b --inputs structured --length 131072 --patterns "vs:1000,6096;ashape:64,4096;bs:100" --variants "flat:4,2;flat:4,1;flat:4,3;default:4,2;default:4,3;default:8,2" --repeats 3 --warmup 1 --budget-s 200 --out "$OUT/d128_64row_sweep2.json" 2>&1 | tee "$OUT/run_c.log"
