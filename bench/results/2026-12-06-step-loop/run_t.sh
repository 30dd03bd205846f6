# One call (one GPU, ~400 s): a request joining or leaving the decoding batch, before and after 27a0318 (the
# own-KV pool in one tensor per kind: 3 copies a row at any depth, was ~1,550 at 32 layers x 16 rows). Trees: this
# one (new) and .prev (`git archive 73efa0a starshard launch`, before it). 4 and 16 questions on one cached
# document of a length drawn now, each count twice: the first questions often extend a step ahead of the rest and
# leave a step early, which the runs' timelines (kind, count, busy ms, idle ms before) and idle_while_decoding_s
# show. Then the shared-part kernel through the kept graphs' table against the general launch (table_probe.py: is
# the 16-question 1.17x the kernel?), and the decode step at 128K against the bytes bound, bf16 and --fp8 kv,
# beside a large copy's read rate (issue 47's 1.2x).
. bench/results/2026-12-06-step-loop/prelude.sh
LEN=$(python3 -c "import random; print(random.randrange(98304, 170001))"); echo "length $LEN"
for tree in new prev; do
  P=$PWD; [ $tree != new ] && P=$PWD/.$tree
  TRITON_CACHE_DIR=/tmp/tc_$tree timeout 120 env PYTHONPATH=/tmp/site:$P python3 -P -m starshard bench serve $L8B \
    --scenario document --lengths $LEN --cache-gib 30 --decode-tokens 32 --concurrency 4,16,4,16 \
    --out $OUT/serve_$tree.json > $OUT/log_$tree.txt 2>&1; t serve_$tree
  grep -h "decode graphs\|Traceback\|Error" $OUT/log_$tree.txt | head -3
done
timeout 60 $NEW bench/results/2026-12-06-step-loop/table_probe.py $OUT/table_probe.json "$LEN,131072" \
  > $OUT/log_table.txt 2>&1; t table_probe; tail -6 $OUT/log_table.txt
for fp8 in "" "--fp8 kv"; do
  n=bf16; [ -n "$fp8" ] && n=fp8kv
  timeout 100 $NEW -m starshard bench prefill $L8B --lengths 131072 --decode-steps 32 $fp8 \
    --out $OUT/decode_$n.json > $OUT/log_d$n.txt 2>&1; t decode_$n
done
cat $OUT/log_*.txt > $OUT/all.log 2>/dev/null; rm -f $OUT/log_*.txt
python3 bench/results/2026-12-06-step-loop/summary.py $OUT 2>&1 | head -40
