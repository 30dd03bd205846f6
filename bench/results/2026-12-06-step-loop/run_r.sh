# One call (one GPU): the table decode (the service's kept decode graphs) loaded the cache element by element: its
# K / V bases, read on the device, carried no alignment, so Triton 3.6 built it with 255 registers and spills and
# no pipelined loads (ptxas -v at sm_90a); h100-g's steps were 4-5x h100-c's (55.7 vs 11.3 ms, one question).
# This tree promises 16-element offsets (tl.multiple_of; table_row refuses others). Trees: this one (new), .head
# (`git archive 50140a8 starshard launch`, before it), .base (the parent 2f17e11, `git archive`).
# In order of need, each phase started only while the call's time (END seconds, default 500) allows:
# 0. the GPU tests of the kept graphs; 1. 1 / 4 / 8 / 16 questions on one cached document of a length drawn now,
# this tree then .head (decode steps); 2. the warm-up of new / base / head, each on its own empty Triton cache,
# with the variants each compiled; 3. the parent's 1 / 16 questions.
. bench/results/2026-12-06-step-loop/prelude.sh
END=${END:-500}; . bench/results/2026-12-06-step-loop/phases.sh
serve new 1,4,8,16; serve head 1,4,8,16
A="serve $L8B --scenario document --lengths 100003 --cache-gib 30 --decode-tokens 2 --concurrency 1,16"
for tree in new base head; do
  P=$PWD; [ $tree != new ] && P=$PWD/.$tree
  TC=/tmp/triton_w$tree; rm -rf $TC; mkdir -p $TC
  go 80 && TRITON_CACHE_DIR=$TC timeout 80 env PYTHONPATH=/tmp/site:$P python3 -P -c "$W" $A --out $OUT/warmup_$tree.json \
    > $OUT/log_w$tree.txt 2>&1; t warmup_$tree
  grep -h "warm-up:" $OUT/log_w$tree.txt 2>/dev/null | cut -c1-220
  find $TC -name "*.json" ! -name "__grp__*" -printf "%f\n" | sed 's/\.json$//' | sort | uniq -c | sort -rn > /tmp/k_$tree.txt
  echo "$tree: $(ls $TC | wc -l) compiled variants"
done
echo "== variants per kernel: this tree | parent | head"
join -1 2 -2 2 -a 1 -a 2 -e 0 -o 0,1.1,2.1 <(sort -k2 /tmp/k_new.txt) <(sort -k2 /tmp/k_base.txt) | sort -k1,1 \
  | join -a 1 -a 2 -e 0 -o 0,1.2,1.3,2.2 - <(awk '{print $2, $1}' /tmp/k_head.txt | sort -k1,1) | awk '$2 != $3 || $3 != $4' \
  | awk '{printf "%-60s %4s %4s %4s\n", $1, $2, $3, $4}'  # the device image has no `column`
serve base 1,16
cat $OUT/log_*.txt > $OUT/all.log 2>/dev/null; rm -f $OUT/log_*.txt
grep -h "Traceback\|Error" $OUT/all.log | head -5
python3 bench/results/2026-12-06-step-loop/summary.py $OUT 2>&1 | grep -v "^ *prefill" | head -40
