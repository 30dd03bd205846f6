# One call (one GPU): issue 47's last measurements. The GPU tests of the kept decode graphs, the split reload and
# the lookahead's token read; 16 questions on a cached document against the device's step time on three lengths
# drawn now in [96K, 180K] with serve's default warm-up (h100-e/ ran it before the read waited on its step's event
# and before the decode past max_tokens went); the warm-up against the parent's (`-P`: h100-e's "parent" was this
# tree), each with an empty Triton cache.
. bench/results/2026-12-06-step-loop/prelude.sh
go() { [ $(( $(date +%s) - S )) -lt $1 ]; }
timeout 170 $NEW -m pytest -q -p no:cacheprovider tests/gpu/test_table_graphs_gpu.py tests/gpu/test_split_reload_gpu.py \
  tests/gpu/test_windowed_cascade.py tests/gpu/test_lookahead_gpu.py > $OUT/gpu_tests.txt 2>&1; t gpu_tests; tail -3 $OUT/gpu_tests.txt
LENS=$(python3 -c "import random; print(','.join(str(x) for x in sorted(random.sample(range(98304, 180001), 3))))")
echo "lengths $LENS"
timeout 220 $NEW -m starshard bench serve $L8B --scenario document --lengths $LENS --cache-gib 30 --decode-tokens 16 \
  --concurrency 1,16 --out $OUT/serve_chunk.json > $OUT/log_sc.txt 2>&1; t serve_chunk
# the warm-up (now also capturing the kept graphs) against the parent's, same flags, each with an empty Triton cache
A="bench serve $L8B --scenario document --lengths 100003 --cache-gib 30 --decode-tokens 2 --concurrency 1,16"
for tree in new base; do
  P=$PWD; [ $tree = base ] && P=$PWD/.base  # .base: `git archive 2f17e11 starshard launch`
  go 480 && TRITON_CACHE_DIR=$(mktemp -d) timeout 80 env PYTHONPATH=/tmp/site:$P python3 -P -m starshard $A \
    --out $OUT/warmup_$tree.json > $OUT/log_w$tree.txt 2>&1; t warmup_$tree
done
cat $OUT/log_*.txt > $OUT/all.log; rm -f $OUT/log_*.txt
grep -h "Traceback\|Error\|warm-up:" $OUT/all.log | head -12
python3 bench/results/2026-12-06-step-loop/summary.py $OUT 2>&1 | grep -v "^ *prefill" | head -30
python3 -c "
import json, sys
for n in ('serve_chunk', 'warmup_new', 'warmup_base'):
    try:
        d = json.load(open('$OUT/' + n + '.json'))
    except OSError:
        continue
    print(n, 'warmup_s', d.get('warmup_s'), 'decode graphs kept', d.get('engine_stats', {}).get('decode_graphs_kept'))"
