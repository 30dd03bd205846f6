#!/bin/bash
# (decode_merge_check.py ran from bench/ then; it is kept beside this script and needs the reverted counters= argument.)
# Call B: the split-KV decode's merge inside the split kernel and the new split count (this tree) vs .base
# (6fa28da, the session's start). 1) bench/decode_merge_check.py: bit equality (eager, 200 graph replays) and
# us per call, merge in the kernel vs two launches; 2) bench/decode_splits.py with the new built-in count;
# 3) launch/bench.py moe decode at 4K / 32K, .base then this tree (Qwen3-30B-A3B shape, random weights).
LOG=run_b.log; source bench/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
T=200 step python3 bench/decode_merge_check.py --out "$OUT/decode_merge_b.json"
T=120 step python3 bench/decode_splits.py --out "$OUT/decode_splits_b.json"
M="launch/bench.py moe --random-weights qwen3-30b-a3b --skip-hf --prefill-lengths 4096 --repeats 1 --decode-contexts 4096,32768 --decode-steps 32"
PYTHONPATH=/tmp/site:$PWD/.base T=150 step python3 .base/$M --out "$OUT/moe_base_b.json"
T=150 step python3 $M --out "$OUT/moe_new_b.json"
grep -h "Traceback\|Error" "$LOG" | head
for f in "$OUT"/moe_*_b.json; do python3 -c "
import json, sys; d = json.load(open(sys.argv[1]))
print(sys.argv[1].split('/')[-1], [(r['context'], round(1e3 * r['step_seconds'], 3), round(r['measured_over_bytes_bound'], 2)) for r in d['decode']])" "$f" | tee -a "$LOG"; done
