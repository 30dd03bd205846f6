#!/bin/bash
# Device call A (one H200): FP8 GEMV variants for decode, and where a 128K prefill's time goes (bf16 vs
# --fp8 linear,kv), 2 decoder layers of the Llama-3.1-8B shape, random weights and token ids.
LOG=run_a.log; source bench/gpu_env.sh
T=330 step python bench/fp8_gemv_variants.py --out $OUT/gemv_variants.json
T=120 step python bench/profile_prefill.py --layers 2 --prompt-len 131072 --out $OUT/prefill_prof_none.json
T=120 step python bench/profile_prefill.py --layers 2 --prompt-len 131072 --fp8 linear,kv --out $OUT/prefill_prof_fp8.json
