#!/bin/bash
# Call H5 (warm after H3: the SmolLM2 checkpoint is in /tmp): a second, larger harness sample on the GPU
# kernels (400 prompts, seed 11, as ../2026-11-25-h200/run_d.sh), bf16 / `--fp8 attention` (variant s) /
# the same on variant t; then the Llama-3.1-8B shape 128K prefill (random weights, warm-up 1, one run)
# with --fp8 linear,kv,attention on variant s and on variant t.
LOG=run_h5.log; source bench/gpu_env.sh
smol_model || exit 1
ACC=$OUT/acc; mkdir -p $ACC
E="launch/eval.py --model $SMOL --lengths 1024,2048,4096,8192 --depths 0.1,0.3,0.5,0.7,0.9 --samples-per-cell 4 --seed 11 --tasks passkey,niah_essay,multikey,multiquery,variable_tracking --device cuda --dtype bfloat16 --no-progress"
W=bench/results/2026-11-26-h200-fp8-pv/with_variant_t.py
(timeout 400 python3 $E --fp8 none --strategy-name fp8-none --out $ACC/fp8-none > $ACC/fp8-none.log 2>&1; echo "none rc=$?" | tee -a "$LOG") &
(timeout 400 python3 $E --fp8 attention --strategy-name fp8-attention-s --out $ACC/fp8-attention-s > $ACC/fp8-attention-s.log 2>&1; echo "s rc=$?" | tee -a "$LOG") &
(timeout 400 python3 $W $E --fp8 attention --strategy-name fp8-attention-t --out $ACC/fp8-attention-t > $ACC/fp8-attention-t.log 2>&1; echo "t rc=$?" | tee -a "$LOG") &
wait
T=60 step python3 launch/eval.py --compare $ACC/fp8-none $ACC/fp8-attention-s $ACC/fp8-attention-t --out $ACC
cp $ACC/compare.md "$OUT/compare_h5.md"
P="launch/bench.py prefill $L8B --cp-strategy dense --lengths 131072 --warmup 1 --repeats 1 --decode-steps 0 --fp8 linear,kv,attention"
T=120 step python3 $P --out $OUT/l8b_128k_attention_s.json
T=120 step python3 $W $P --out $OUT/l8b_128k_attention_t.json
grep -h "Traceback\|Error\|with_variant_t" "$LOG" $ACC/*.log | head
head -20 "$OUT/compare_h5.md" | tee -a "$LOG"
grep -h '"prefill_seconds"' $OUT/l8b_128k_*.json | tee -a "$LOG"
cd "$OUT" && tar czf acc_h5.tgz acc && rm -rf acc
