#!/bin/bash
# Call T: flash_fp8 variant t (variant s's int8 smoothed scores with variant b's e4m3 P . V) against s, b
# and cuDNN bf16 on one H200: the CUDA tests, then bench/fp8_prefill_attention.py on Llama-8B heads in the
# model's strided layout (tile sweep at 32K, 32K and 128K timed, output / lse error vs float32 on rows).
LOG=run_t.log; source bench/gpu_env.sh
T=200 step python3 -m pytest tests/test_flash_fp8.py -q -k cuda
T=400 step python3 bench/fp8_prefill_attention.py --lengths 32768,131072 --variants s,t,b --layout model \
  --sweep-length 32768 --configs "128,128,8,3:tma 64,128,4,3:tma 128,64,8,3:tma 128,128,8,2:tma 64,64,4,3:tma" \
  --repeats 5 --out $OUT/attention_t.json
grep "^|" "$LOG" | tail -12
