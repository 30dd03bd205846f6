#!/usr/bin/env bash
# Ran as bench/run_gpu12.sh with the code at commit bf86642; run it from the repo root (it sources bench/gpu_env.sh).
# 2 x H200: CUDA-graph decode over a CP group (sharded KV, merge inside the graph) vs eager: tokens
# and step time (ring and Star, cp=2), and ring cp=2 decode at 128K in the bench tool.
LOG=run12.log; source bench/gpu_env.sh
for s in ring star; do
  T=120 step torchrun --nproc-per-node 2 bench/check_graph_decode.py $L8B --cp 2 --cp-strategy $s --prompt-len 32768 --steps 32
done
T=150 step torchrun --nproc-per-node 2 launch/bench.py prefill $L8B --cp 2 --cp-strategy ring --lengths 131072,131072 --warmup 0 --repeats 1 --decode-steps 32 --out "$OUT/ring_cp2_decode_graphs.json"
grep -h "Traceback\|Error" "$LOG" | head
