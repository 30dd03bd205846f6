#!/bin/bash
# Device call E (one H200, warm after D): where a sparse 128K SmolLM2 prefill's time goes: device kernels vs
# wall (bench/profile_prefill.py with real weights, essay text): dense, recall-0.98 and recall-0.99 configs.
LOG=run_e.log; source bench/gpu_env.sh
SMOL=/tmp/ss_cache/smollm2-135m-instruct-q4_1-f32
R=bench/results/2026-11-25-h200-e2e
PP="python3 bench/profile_prefill.py --model $SMOL --prompt-file /tmp/essay.txt --prompt-len 131072 --repeats 2"
T=90 step $PP --out $OUT/prof_dense.json
T=90 step $PP --sparse minference --sparse-config bench/results/2026-11-25-cpu-minference-search/smollm2_minference_8k_recall98.json --out $OUT/prof_recall98.json
T=90 step $PP --sparse minference --sparse-config $R/smollm2_minference_8k_recall99.json --out $OUT/prof_recall99.json
grep -h "Traceback\|Error" "$LOG" | head -5
grep -h -A14 "^prefill" "$LOG"
