#!/bin/bash
# The standing cp=4 task, on the first x4 machine lent (4 x H200), with the ~500 s of device time this
# session had left: one attention layer per strategy (Llama-3.1-8B heads, 32 / 8, d 128, bf16) over the
# CP group, 128K to 1M, with dense and torch's context_parallel (ring over SDPA) as peers in the same
# run (launch/bench.py attention); then the whole model (random weights) at 128K: Star (block = anchor
# = 32K) and APB (defaults) over 4 GPUs, then USP (ulysses degree 2) if time is left.
LOG=run_cp4.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a "$LOG"
T=200 step torchrun --nproc-per-node 4 launch/bench.py attention --cp 4 --strategies dense,ring,ulysses,torch-cp \
  --lengths 131072,524288,1048576 --repeats 1 --out $OUT/attention_cp4.json
W="--warmup 0 --repeats 1 --decode-steps 0 --lengths 131072"
T=90 step torchrun --nproc-per-node 4 launch/bench.py prefill $L8B --cp 4 --cp-strategy star --block-size 32768 --anchor-size 32768 $W --out $OUT/star_cp4_128k.json
T=90 step torchrun --nproc-per-node 4 launch/bench.py prefill $L8B --cp 4 --cp-strategy apb $W --out $OUT/apb_cp4_128k.json
T=90 step torchrun --nproc-per-node 4 launch/bench.py prefill $L8B --cp 4 --cp-strategy usp --ulysses-degree 2 $W --out $OUT/usp_cp4_128k.json
grep -h "Traceback\|Error" "$LOG" | head
grep -h '^|' "$LOG" | head -40
grep -h '"prefill_seconds"' $OUT/*_cp4_128k.json
