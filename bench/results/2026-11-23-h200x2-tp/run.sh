#!/usr/bin/env bash
# Ran as bench/run_gpu8.sh as of commit 4028806, before the benchmark programs became `launch/bench.py`
# subcommands: launch/bench_tp.py is now `launch/bench.py tp`.
# 2 x H200 (NVLink): tensor parallel tp=1 vs tp=2, Llama-3.1-8B shape, random bf16 weights: prefill
# at 8K / 32K and decode tokens/s (issue 3), plus greedy tokens of tp=2 vs tp=1 under NCCL.
LOG=run8.log; source bench/gpu_env.sh
T=140 step torchrun --standalone --nproc-per-node 1 launch/bench_tp.py --lengths 8192,32768 --decode-steps 32 --repeats 2 --out "$OUT/tp1.json"
T=160 step torchrun --standalone --nproc-per-node 2 launch/bench_tp.py --tp 2 --lengths 8192,32768 --decode-steps 32 --repeats 2 --out "$OUT/tp2.json"
for tp in 1 2; do
  T=90 step torchrun --standalone --nproc-per-node $tp launch/infer.py --random-weights llama-3.1-8b --prompt-len 4096 --tp $tp --max-new-tokens 16 --json --no-cuda-graphs
done
grep -h '"token_ids"' "$LOG" | python3 -c "import json,sys; r=[json.loads(l)['token_ids'] for l in sys.stdin]; print(json.dumps({'tp1': r[0], 'tp2': r[1], 'same': r[0]==r[1]}))" | tee -a "$LOG"
