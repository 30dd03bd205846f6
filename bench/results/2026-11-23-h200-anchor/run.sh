#!/usr/bin/env bash
# Ran as bench/run_gpu10.sh as of commit 7e24a21, before the benchmark programs became `launch/bench.py`
# subcommands: launch/bench_anchor.py is now `launch/bench.py anchor`.
# One H200: AnchorAttention vs cuDNN dense and Vertical-Slash at 32K-128K (issue 9), with a theta sweep
# (density / recall / time trade-off) and the 128K point the earlier run lost to an out-of-memory.
LOG=run10.log; source bench/gpu_env.sh
T=420 step python3 launch/bench_anchor.py --device cuda --lengths 32768,65536,131072 --thetas 4,8,12 --vs "1000,6096;2000,8192" --repeats 3 --warmup 1 --out "$OUT/anchor.json"
grep -h "Traceback\|Error" "$LOG" | head
