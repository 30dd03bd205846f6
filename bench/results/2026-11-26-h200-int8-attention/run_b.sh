#!/bin/bash
# Device call B (warm or fresh nvidia-h200, carry .whl): call A's end-to-end run showed no gain from
# --fp8 attention (10.113 vs 10.099 s) while the kernel alone was 1.09x cuDNN: the model passes V in the
# projections' strided layout, which turned the kernel's TMA loads off. Now V is copied contiguous first.
# Kernel at 128K in the model's layout (cuDNN gets the same strided inputs), then end to end again.
LOG=run_b.log
source bench/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$LOG"
T=120 step python3 bench/fp8_prefill_attention.py --lengths 131072 --variants s --sweep-length 0 --layout model \
  --repeats 5 --q-scales 4 --out $OUT/attention_model_layout.json
for fp8 in linear,kv linear,kv,attention none; do
  T=100 step python3 launch/bench.py prefill $L8B --cp-strategy dense --lengths 131072 --warmup 1 --repeats 1 \
    --decode-steps 0 --fp8 $fp8 --out $OUT/prefill_128k_${fp8//,/_}.json
done
grep "^|" "$LOG" | tail -4
