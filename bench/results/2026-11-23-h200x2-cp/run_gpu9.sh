#!/usr/bin/env bash
# Ran as bench/run_gpu9.sh with the code at commit bda6775; run it from the repo root (it sources bench/gpu_env.sh).
# 2 x H200 (NVLink): the CP strategies end to end, Llama-3.1-8B shape, random bf16 weights (issues 4, 6,
# 7): dense on one GPU (the rate the FLOP models are read against), ring and Ulysses, Star (block =
# anchor = 32K) and APB (anchor 4K, passing 2K; and passing 0, whose difference bounds the exposed
# all-gather plus the compressor) on two, 128K to 1M as far as time allows. Each list starts with a
# 128K run that warms the process (--warmup 0): its row is the cold start, the next 128K row is warm.
LOG=run9.log; source bench/gpu_env.sh
W="--warmup 0 --repeats 1 --decode-steps 16"
T=90 step python3 launch/bench.py prefill $L8B --cp-strategy dense --lengths 131072,131072 $W --out "$OUT/dense_1gpu.json"
T=100 step torchrun --nproc-per-node 2 launch/bench.py prefill $L8B --cp 2 --cp-strategy ring --lengths 131072,131072,262144 $W --out "$OUT/ring_cp2.json"
T=60 step torchrun --nproc-per-node 2 launch/bench.py prefill $L8B --cp 2 --cp-strategy ulysses --lengths 131072,131072 $W --out "$OUT/ulysses_cp2.json"
T=150 step torchrun --nproc-per-node 2 launch/bench.py prefill $L8B --cp 2 --cp-strategy star --block-size 32768 --anchor-size 32768 --lengths 131072,131072,262144,524288,1048576 $W --out "$OUT/star_cp2.json"
T=130 step torchrun --nproc-per-node 2 launch/bench.py prefill $L8B --cp 2 --cp-strategy apb --anchor-size 4096 --passing-size 2048 --lengths 131072,131072,262144,524288 $W --out "$OUT/apb_cp2.json"
T=50 step torchrun --nproc-per-node 2 launch/bench.py prefill $L8B --cp 2 --cp-strategy apb --anchor-size 4096 --passing-size 0 --lengths 131072,131072 $W --out "$OUT/apb_cp2_nopass.json"
grep -h '"error"\|Traceback\|Error' "$LOG" | head -20
