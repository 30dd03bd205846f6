#!/bin/bash
# Call F: the index build before (.base = ce8acde, the session's start) and after (working tree:
# diagonal runs + their cost in one launch, the column lists' kernel reading the runs directly,
# runs reused by the plan, unsorted top-k), same machine, random bf16 q / k; profile of the new build.
LOG=run_f.log; source bench/gpu_env.sh
for tree in base new; do
  if [ $tree = base ]; then PP=/tmp/site:$PWD/.base; else PP=/tmp/site:$PWD; fi
  prof=""; [ $tree = new ] && prof=--profile
  PYTHONPATH=$PP step python3 bench/minference_index_bench.py --out $OUT/${tree}_smollm2_128k.json $prof
  PYTHONPATH=$PP step python3 bench/minference_index_bench.py --out $OUT/${tree}_llama8b_128k.json --heads 32 --kv-heads 8 --head-dim 128
  PYTHONPATH=$PP T=400 step python3 bench/minference_index_bench.py --out $OUT/${tree}_smollm2_512k.json --length 524288
done
grep -E '"(select_ms_triton|index_ms_triton|plan_ms_gpu|plan_ms_wall|runs_equal|runs_ms_triton|runs_ms_torch|index_equal)"' $OUT/*_*.json
grep -B3 -A40 "Self CPU %" $LOG | cut -c1-60,150-250
