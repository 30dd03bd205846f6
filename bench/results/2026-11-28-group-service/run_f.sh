# call F (4 GPUs): the host tier's pinned arena (pinned once at start, shards carved from it): a 128K document's
# demotion and follow-ups from host and cold disk on one GPU; on another GPU the CUDA tests of the windowed
# cascade's captured graph, the window kernels and the arena (Gemma chunk 3 of 4 rides along)
. bench/results/2026-11-28-group-service/prelude.sh
D=/tmp/ss-kv; rm -rf $D
C="$L8B --lengths 131072 --concurrency 1 --cache-gib 24 --disk-cache-dir $D --disk-cache-gib 20 --seed 0"
CUDA_VISIBLE_DEVICES=0 timeout 300 python3 launch/bench.py serve $C --host-cache-gib 20 --tiers host,disk --out $OUT/tiers_arena_1gpu_128k.json > $OUT/log0.txt 2>&1 &
( python3 -m pytest --version > /dev/null 2>&1 || python3 -m pip install -q --no-index --no-deps --target /tmp/site .probe/pyt/*.whl
  CUDA_VISIBLE_DEVICES=1 timeout 250 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_windowed_cascade.py tests/gpu/test_window_kernels.py tests/serving/test_pinned_arena.py > $OUT/log1.txt 2>&1 ) &
wait; t all
rm -rf $D
cat $OUT/log*.txt > $OUT/all.log; rm $OUT/log*.txt
tail -5 $OUT/all.log; grep -h "slow step\|Traceback\|Error\|pinn" $OUT/all.log | head -30
