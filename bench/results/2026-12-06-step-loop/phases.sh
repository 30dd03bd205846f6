# Sourced after prelude.sh by the calls that compare trees on one cached document (run_r.sh, run_u.sh): the phase
# budget (END seconds), the GPU tests of the kept graphs, a document length drawn now, `serve TREE CONCURRENCY`
# (this tree `new`, else .TREE, each on its own Triton cache) and the warm-up command W (the log's phases timed).
END=${END:-500}  # run_r.sh and run_u.sh set their own first
go() { [ $(( $(date +%s) - S + $1 )) -lt $END ]; }  # a phase that may take $1 more seconds fits
# the kept graphs on the card with this tree's kernel (their logits against the per-batch path's)
[ "${TESTS:-1}" = 1 ] && { timeout 100 $NEW -m pytest -q -p no:cacheprovider tests/gpu/test_table_graphs_gpu.py \
  tests/gpu/test_lookahead_gpu.py > $OUT/log_gpu.txt 2>&1; t gpu_tests; tail -2 $OUT/log_gpu.txt; }  # TESTS=0 skips
LEN=$(python3 -c "import random; print(random.randrange(98304, 180001))"); echo "length $LEN"
serve() {  # tree, concurrency
  P=$PWD; [ $1 != new ] && P=$PWD/.$1; mkdir -p /tmp/triton_$1
  go 110 && TRITON_CACHE_DIR=/tmp/triton_$1 timeout 110 env PYTHONPATH=/tmp/site:$P python3 -P -m starshard bench serve \
    $L8B --scenario document --lengths $LEN --cache-gib 30 --decode-tokens 32 --concurrency $2 \
    --out $OUT/serve_$1.json > $OUT/log_s$1.txt 2>&1; t serve_$1
}
W="import logging, sys; logging.basicConfig(level=logging.INFO, format='%(relativeCreated)d %(message)s')
from starshard.commands.bench import main; main(sys.argv[1:])"
