# The GPU checks of this tree (tests/gpu on two GPUs, the CUDA-graph decode tests through the test harness's
# rank processes) and, beside them on GPU 1, the window-trimmed context cache through the host and disk tiers
# on a GPU (gemma-3-4b shape, random weights, a 131000-token prompt: the model's window is 131072):
# demotion, the host follow-up and the cold disk read, then a restart on the same directory (--reuse-only).
. bench/results/2026-11-28-group-service/prelude.sh
T="--random-weights gemma-3-4b --dtype bfloat16 --lengths 131000 --concurrency 1 --cache-gib 24 --host-cache-gib 20 \
 --disk-cache-dir /tmp/kv --disk-cache-gib 24 --no-warmup"
( CUDA_VISIBLE_DEVICES=1 timeout 280 python3 launch/bench.py serve $T --tiers host,disk --out $OUT/tiers_gemma4b.json \
    > $OUT/tiers.log 2>&1; t tiers
  CUDA_VISIBLE_DEVICES=1 timeout 150 python3 launch/bench.py serve $T --reuse-only --out $OUT/tiers_gemma4b_restart.json \
    >> $OUT/tiers.log 2>&1; t restart ) &
timeout 480 python3 -m pytest tests/gpu tests/runtime/test_cuda_graph.py -q -p no:cacheprovider > $OUT/gpu_tests.log 2>&1
t gpu_tests
wait
tail -3 $OUT/gpu_tests.log; grep -h "FAILED\|Error" $OUT/gpu_tests.log | head; grep -v "slow step" $OUT/tiers.log | grep -h "Traceback\|Error\|error\|warning" | head
python3 - $OUT <<'PY'
import json, sys
for f in ("tiers_gemma4b.json", "tiers_gemma4b_restart.json"):
    try:
        for r in json.load(open(f"{sys.argv[1]}/{f}"))["results"]:
            print(f, {k: v for k, v in r.items() if not isinstance(v, (dict, list))})
    except OSError as e:
        print(f, e)
PY
