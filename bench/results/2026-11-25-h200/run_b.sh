#!/bin/bash
# Device call B (one H200): e4m3 split-KV decode attention, three ways of feeding the tensor cores
# (bench/fp8_decode_variants.py), 128K keys, Llama-3.1-8B heads.
LOG=run_b.log; source bench/gpu_env.sh
T=500 step python bench/fp8_decode_variants.py --out $OUT/decode_variants.json
