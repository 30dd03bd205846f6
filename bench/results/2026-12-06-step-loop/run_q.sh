# One call (one GPU): where this tree's start-up warm-up spends the 3.7 s it takes over the parent's (h100-g:
# 28.20 s vs 24.50 s, 1.15x). Each tree warms up once on its own empty Triton cache with the log's phases on;
# then the kernels each compiled are listed by name and count (a cache directory per compiled variant, its
# <kernel>.json naming it), so the variants only this tree compiles, and how many, are on one page.
. bench/results/2026-12-06-step-loop/prelude.sh
W="import logging, sys; logging.basicConfig(level=logging.INFO, format='%(relativeCreated)d %(message)s')
from starshard.commands.bench import main; main(sys.argv[1:])"
A="serve $L8B --scenario document --lengths 100003 --cache-gib 30 --decode-tokens 2 --concurrency 1,16"
for tree in new base; do
  P=$PWD; [ $tree = base ] && P=$PWD/.base
  TC=/tmp/triton_$tree; rm -rf $TC; mkdir -p $TC
  TRITON_CACHE_DIR=$TC timeout 90 env PYTHONPATH=/tmp/site:$P python3 -P -c "$W" $A --out $OUT/warmup_$tree.json \
    > $OUT/log_w$tree.txt 2>&1; t warmup_$tree
  grep -h "warm-up:" $OUT/log_w$tree.txt
  find $TC -name "*.json" ! -name "__grp__*" -printf "%f\n" | sed 's/\.json$//' | sort | uniq -c | sort -rn > $OUT/kernels_$tree.txt
  echo "$tree: $(ls $TC | wc -l) compiled variants"
done
echo "== variants per kernel, this tree | parent"; join -1 2 -2 2 -a 1 -a 2 -e 0 -o 0,1.1,2.1 \
  <(sort -k2 $OUT/kernels_new.txt) <(sort -k2 $OUT/kernels_base.txt) | awk '$2 != $3' | column -t
cat $OUT/log_*.txt > $OUT/all.log; rm -f $OUT/log_*.txt
python3 -c "
import json
for n in ('new', 'base'):
    print(n, 'warmup_s', json.load(open('$OUT/warmup_' + n + '.json')).get('warmup_s'))"
