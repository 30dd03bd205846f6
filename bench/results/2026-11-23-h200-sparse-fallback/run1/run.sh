#!/usr/bin/env bash
# First call (its output is this directory, run.log included; see ../run.sh; index_split.py then lacked
# the old-step timing). One H200 (device tool, nvidia-h200), 2026-11-23, bf16, Llama-3.1-8B shape with random weights:
# issue 18 item 1, "never slower than dense". --sparse minference / anchor now skip estimation
# below the measured minimum length (SparseConfig.min_length: 64K keys MInference, 32K anchor on
# CUDA) and send every head whose sparse kernel would not beat the dense kernel (measured rates,
# minference.plan.H200_RATES, anchor.H200_ANCHOR_RATES) to the dense kernel. Before (issue 18, same
# command on one H200): dense 11.46 s, --sparse minference 28.86 s at 128K.
#  1. end-to-end prefill at 128K and 32K, dense vs --sparse minference (JSON rows carry sparse_report);
#  2. index_split.py: one layer at 64K / 128K, where the time of the choice goes (estimate, runs cost,
#     column lists: the vs_index rate in H200_RATES), the call with and without the fallback;
#  3. --sparse anchor at 128K (theta 12 on random weights: stripes keep most keys).
# Run from the repo root with the megatron-core wheel in .whl (carried): bash bench/results/2026-11-23-h200-sparse-fallback/run.sh
LOG=run.log; source bench/gpu_env.sh
D=bench/results/2026-11-23-h200-sparse-fallback
P="launch/bench.py prefill $L8B --cp-strategy dense --warmup 0 --repeats 1 --decode-steps 0"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$LOG"
T=120 step python3 $P --lengths 131072 --out "$OUT/dense_128k.json"
T=150 step python3 $P --lengths 131072 --sparse minference --out "$OUT/minference_128k.json"
T=90 step python3 $P --lengths 32768 --out "$OUT/dense_32k.json"
T=90 step python3 $P --lengths 32768 --sparse minference --out "$OUT/minference_32k.json"
T=150 step python3 $D/index_split.py --out "$OUT/index_split.json"
T=150 step python3 $P --lengths 131072 --sparse anchor --out "$OUT/anchor_128k.json"
grep -h "Traceback\|Error" "$LOG" | head
grep -h '"prefill_seconds"' "$LOG" | cut -c1-400
