# call D (4 GPUs; Gemma chunk 2 of 4): issue 38, Gemma 3 4B over cp=4 ring (K/V bytes a local layer sends against a
# global one, and the speedup over the ring); issue 37, 512K over cp=4 ring: the host tier's follow-up against the prefill.
. bench/results/2026-11-28-group-service/prelude.sh
G4B="--random-weights gemma-3-4b --dtype bfloat16 --lengths 131072 --decode-steps 0 --all-global"
timeout 120 torchrun --nproc-per-node 4 launch/bench.py prefill $G4B --cp 4 --cp-strategy ring --warmup 1 --repeats 1 --out $OUT/gemma3_4b_ring4.json > $OUT/log0.txt 2>&1; t ring4_bytes
timeout 170 torchrun --nproc-per-node 4 launch/bench.py serve $L8B --cp 4 --cp-strategy ring --lengths 524288 --concurrency 1 --cache-gib 24 --host-cache-gib 20 --tiers host --no-warmup --out $OUT/tiers_ring4_512k.json > $OUT/log1.txt 2>&1; t tiers_ring4
cat $OUT/log*.txt > $OUT/all.log; rm $OUT/log*.txt
grep -h "slow step\|Traceback\|Error" $OUT/all.log | head -20
python3 bench/results/2026-11-28-windows/summary.py $OUT/gemma3_4b_ring4.json 2>&1 | tail -12
python3 -c "
import json; d=json.load(open('$OUT/tiers_ring4_512k.json'))
for r in d['results']: print({k: v for k, v in r.items() if 'ttft' in k or 'over' in k or k == 'length' or 'demote' in k})" 2>&1 | tail -3
