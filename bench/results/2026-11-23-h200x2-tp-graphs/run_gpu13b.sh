#!/usr/bin/env bash
# Not run yet (bench/run_gpu13b.sh, written at 75c6d62; no 2-GPU machine was lent since): its step now calls
# `launch/bench.py tp`, which replaced launch/bench_tp.py. Its results go to a new directory when it runs.
# 2 x H200: bench_tp.py tp=2 with graph decode, after releasing the graph before teardown (run13's
# bench_tp step wrote its JSON, then hung in destroy_process_group with the graph alive).
LOG=run13b.log; source bench/gpu_env.sh
T=150 step torchrun --standalone --nproc-per-node 2 launch/bench.py tp --tp 2 --lengths 8192,32768 --decode-steps 32 --repeats 2 --out "$OUT/tp2_graphs.json"
grep -h "Traceback\|Error" "$LOG" | head
