#!/bin/bash
# Call H3 (warm after run_g1.sh / run_g2.sh of ../2026-11-26-h200-index-build as H1 / H2; carry .whl and
# .smol3/part_ac): harness accuracy on the GPU kernels, SmolLM2-135M real weights, 200 prompts (1K-8K,
# 5 tasks, seed 7, as ../2026-11-25-h200/run_f.sh), three runs side by side: bf16, `--fp8 attention`
# (variant s), and `--fp8 attention` on variant t (with_variant_t.py); then eval.py --compare.
LOG=run_h3.log; source bench/gpu_env.sh
smol_model || exit 1
ACC=$OUT/acc; mkdir -p $ACC
E="launch/eval.py --model $SMOL --lengths 1024,2048,4096,8192 --depths 0.1,0.3,0.5,0.7,0.9 --samples-per-cell 2 --seed 7 --tasks passkey,niah_essay,multikey,multiquery,variable_tracking --device cuda --dtype bfloat16 --no-progress"
W=bench/results/2026-11-26-h200-fp8-pv/with_variant_t.py
(timeout 500 python3 $E --fp8 none --strategy-name fp8-none --out $ACC/fp8-none > $ACC/fp8-none.log 2>&1; echo "none rc=$?" | tee -a "$LOG") &
(timeout 500 python3 $E --fp8 attention --strategy-name fp8-attention-s --out $ACC/fp8-attention-s > $ACC/fp8-attention-s.log 2>&1; echo "s rc=$?" | tee -a "$LOG") &
(timeout 500 python3 $W $E --fp8 attention --strategy-name fp8-attention-t --out $ACC/fp8-attention-t > $ACC/fp8-attention-t.log 2>&1; echo "t rc=$?" | tee -a "$LOG") &
wait
T=60 step python3 launch/eval.py --compare $ACC/fp8-none $ACC/fp8-attention-s $ACC/fp8-attention-t --out $ACC
grep -h "Traceback\|Error\|with_variant_t" "$LOG" $ACC/*.log | head
cp $ACC/compare.md "$OUT/compare_h3.md"
head -30 "$OUT/compare_h3.md" | tee -a "$LOG"
cd "$OUT" && tar czf acc_h3.tgz acc && rm -rf acc
