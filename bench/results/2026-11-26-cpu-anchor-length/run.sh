#!/usr/bin/env bash
# AnchorAttention calibrated at recall 0.99 on SmolLM2-135M (real weights, the embedded default) at three
# sample lengths, the paper's pooling (128 rows x step 16, no window): how the per-head theta and the
# density it keeps move with the length. CPU (2 cores), tree 66931c6; run from the repo root.
set -e
OUT=bench/results/2026-11-26-cpu-anchor-length
for L in 4096 8192 16384; do
  n=1; [ $L = 4096 ] && n=2  # as run: two sample prompts at 4K, one at 8K and 16K
  OMP_NUM_THREADS=2 python -m starshard.tools.anchor_calibrate --length $L --samples $n --target-recall 0.99 \
    --out $OUT/anchor_r99_$L.json
done
python $OUT/summarize.py $OUT/anchor_r99_4096.json $OUT/anchor_r99_8192.json $OUT/anchor_r99_16384.json
