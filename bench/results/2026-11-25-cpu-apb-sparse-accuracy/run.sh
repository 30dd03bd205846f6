#!/bin/bash
# CPU (2 cores, float32), the embedded SmolLM2-135M-Instruct: harness accuracy of APB 4 hosts with the
# recall-0.99 MInference config inside, one sparse call over [anchor; passing; block] (tree c35acb7,
# "new") against dense and against the tree before that change (5e2bf16, "old": sparse on the block's own
# keys, the anchor and passing keys dense). 150 prompts: 1K-4K, 5 depths x 2, 5 tasks, seed 7.
# OLD=<checkout of 5e2bf16> for the old run (git worktree add /tmp/old_head 5e2bf16).
set -u
OUT=${OUT:-/tmp/acc}; mkdir -p "$OUT"
R99=$PWD/bench/results/2026-11-25-h200-e2e/smollm2_minference_8k_recall99.json
E="--lengths 1024,2048,4096 --depths 0.1,0.3,0.5,0.7,0.9 --samples-per-cell 2 --seed 7 --tasks passkey,niah_essay,multikey,multiquery,variable_tracking --device cpu --dtype float32 --no-progress"
SP="--cp-strategy apb --apb-hosts 4 --sparse minference --sparse-config $R99 --sparse-min-length 0 --sparse-no-fallback"
python launch/eval.py $E $SP --strategy-name apb4-r99-new --out "$OUT/apb4-r99-new"
python launch/eval.py $E --strategy-name dense --out "$OUT/dense"
(cd "$OLD" && python launch/eval.py $E $SP --strategy-name apb4-r99-old --out "$OUT/apb4-r99-old")
python launch/eval.py --compare "$OUT/dense" "$OUT/apb4-r99-old" "$OUT/apb4-r99-new" --out "$OUT/cmp"
