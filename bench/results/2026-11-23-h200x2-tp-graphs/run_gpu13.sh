#!/usr/bin/env bash
# Ran as bench/run_gpu13.sh as of commit b8e7a35, before the benchmark programs became `launch/bench.py`
# subcommands: launch/bench_tp.py is now `launch/bench.py tp`.
# 2 x H200: CUDA-graph decode with tensor parallelism (tp=2): tokens vs eager and step time, and
# bench_tp.py's tp=1 vs tp=2 decode per step.
LOG=run13.log; source bench/gpu_env.sh
T=120 step torchrun --nproc-per-node 2 bench/check_graph_decode.py $L8B --tp 2 --prompt-len 32768 --steps 32
T=160 step torchrun --standalone --nproc-per-node 2 launch/bench_tp.py --tp 2 --lengths 8192,32768 --decode-steps 32 --repeats 2 --out "$OUT/tp2_graphs.json"
grep -h "Traceback\|Error" "$LOG" | head
