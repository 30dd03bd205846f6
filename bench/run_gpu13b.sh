#!/usr/bin/env bash
# 2 x H200: bench_tp.py tp=2 with graph decode, after releasing the graph before teardown (run13's
# bench_tp step wrote its JSON, then hung in destroy_process_group with the graph alive).
LOG=run13b.log; source bench/gpu_env.sh
T=150 step torchrun --standalone --nproc-per-node 2 launch/bench_tp.py --tp 2 --lengths 8192,32768 --decode-steps 32 --repeats 2 --out "$OUT/tp2_graphs.json"
grep -h "Traceback\|Error" "$LOG" | head
