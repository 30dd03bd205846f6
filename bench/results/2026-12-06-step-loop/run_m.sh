# The start-up warm-up of the parent (.base) and this tree with the same flags, each with its own empty Triton
# cache (whichever runs first on a machine otherwise pays the compilations the other then reads from disk): h100-d/.
. bench/results/2026-12-06-step-loop/prelude.sh
A="bench serve $L8B --scenario document --lengths 100003 --cache-gib 30 --decode-tokens 2 --concurrency 1,16"
for tree in base new; do
  for i in 1; do
    TC=$(mktemp -d); P=$PWD; [ $tree = base ] && P=$PWD/.base
    TRITON_CACHE_DIR=$TC timeout 75 env PYTHONPATH=/tmp/site:$P python3 -P -m starshard $A --out $OUT/$tree.json > $OUT/log_$tree.txt 2>&1; t $tree
    python3 -c "import json; d=json.load(open('$OUT/$tree.json')); print('$tree', 'warmup_s', d['warmup_s'])"
  done
done
