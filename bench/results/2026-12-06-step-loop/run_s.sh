# One short call (one GPU, ~150 s): the table decode's fix (a8266e9) against 50140a8 (.head), 1 and 16 questions
# on one cached document of a length drawn now; the serve's warm-up checks the kept graphs' logits (logged if off).
. bench/results/2026-12-06-step-loop/prelude.sh
LEN=$(python3 -c "import random; print(random.randrange(98304, 110001))"); echo "length $LEN"
for tree in new head; do
  P=$PWD; [ $tree != new ] && P=$PWD/.$tree
  TRITON_CACHE_DIR=/tmp/tc_$tree timeout 85 env PYTHONPATH=/tmp/site:$P python3 -P -m starshard bench serve $L8B \
    --scenario document --lengths $LEN --cache-gib 30 --decode-tokens 24 --concurrency 1,16 \
    --out $OUT/serve_$tree.json > $OUT/log_$tree.txt 2>&1; t serve_$tree
  grep -h "decode graphs\|Traceback\|Error" $OUT/log_$tree.txt | head -3
done
python3 bench/results/2026-12-06-step-loop/summary.py $OUT 2>&1 | grep -v "^ *prefill" | head -20
