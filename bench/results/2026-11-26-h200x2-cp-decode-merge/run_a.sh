#!/bin/bash
# One call on two GPUs (carry .whl, .base): decode over a cp=2 ring group at 128K, the session's starting
# merge (`.base`: an all-reduce of the max lse, one of the packed weighted sums, ~a dozen small kernels per
# layer) against one all-gather + one merge kernel (parallel/context/group_merge.py, kernels/merge.py
# merge_stacked); Llama-3.1-8B shape, random bf16 weights, 64 CUDA-graph decode steps after the prefill.
LOG=run_a.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a "$LOG"
for tree in base new new base; do
  case $tree in base) ROOT=$PWD/.base;; new) ROOT=$PWD;; esac
  export PYTHONPATH=/tmp/site:$ROOT
  T=80 step torchrun --nproc-per-node 2 $ROOT/launch/bench.py prefill $L8B --cp 2 --cp-strategy ring --lengths 131072 --warmup 0 --repeats 1 --decode-steps 64 --out $OUT/${tree}_$RANDOM.json
done
grep -h "Traceback\|Error" "$LOG" | head
grep -h '^{"length"' "$LOG" | grep -o '"prefill_seconds": [0-9.]*\|"step_seconds": [0-9.]*'
