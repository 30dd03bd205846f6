#!/usr/bin/env bash
# One H200 (device tool, nvidia-h200), 2026-11-23, bf16, Llama-3.1-8B shape with random weights:
# issue 18 item 1, "never slower than dense". --sparse minference / anchor skip estimation below the
# measured minimum length (SparseConfig.min_length) and send every head whose sparse kernel would not
# beat the dense kernel (measured rates, minference.plan.H200_RATES, anchor.H200_ANCHOR_RATES) to
# the dense kernel. Before (issue 18, the same prefill command on one H200): dense 11.46 s,
# --sparse minference 28.86 s at 128K.
# As run (both calls): min_length 65536 for MInference and 32768 for anchor, and H200_RATES.vs_index
# 1.45e-9 (run1: 1e-9, provisional); after this call the default became 65537 for both (this call's
# index_split: at 64K the fallback ties dense on structured inputs and loses 13% on random ones) and
# vs_index 1.65e-9 (the largest column-list rate of both calls). Neither changes what these runs
# did: 32K skips and 128K estimates under both bounds, and no head of the random-weight runs reached
# the column lists.
# The device tool returned at most 8 files: this call's run.log did not come back (its prefill rows
# are the JSON files; the commit field is the session's starting commit, the working tree differed).
#  1. end-to-end prefill, dense vs --sparse minference, 128K twice each alternating (single cold runs
#     vary by several %), 32K once (JSON rows carry sparse_report);
#  2. index_split.py: one layer at 64K / 128K, where the time of the choice goes (estimate, runs cost,
#     column lists: the vs_index rate in H200_RATES), the call with and without the fallback;
#  3. --sparse anchor at 128K (theta 12 on random weights: stripes keep most keys).
# run1/ holds the first call (run1/run.sh: the same steps, one 128K run each), made before the
# estimate's step grew (index._ESTIMATE_BUDGET 1 << 26 -> 1 << 28) and with a provisional vs_index
# rate; its index_split.json gave that rate.
# Run from the repo root with the megatron-core wheel in .whl (carried): bash bench/results/2026-11-23-h200-sparse-fallback/run.sh
LOG=run.log; source bench/gpu_env.sh
D=bench/results/2026-11-23-h200-sparse-fallback
P="launch/bench.py prefill $L8B --cp-strategy dense --warmup 0 --repeats 1 --decode-steps 0"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$LOG"
for r in a b; do
  T=120 step python3 $P --lengths 131072 --out "$OUT/dense_128k_$r.json"
  T=150 step python3 $P --lengths 131072 --sparse minference --out "$OUT/minference_128k_$r.json"
done
T=90 step python3 $P --lengths 32768 --out "$OUT/dense_32k.json"
T=90 step python3 $P --lengths 32768 --sparse minference --out "$OUT/minference_32k.json"
T=150 step python3 $D/index_split.py --out "$OUT/index_split.json"
T=150 step python3 $P --lengths 131072 --sparse anchor --out "$OUT/anchor_128k.json"
grep -h "Traceback\|Error" "$LOG" | head
grep -h '"prefill_seconds"' "$LOG" | cut -c1-400
