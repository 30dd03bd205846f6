# call C (4 GPUs): the tiered context cache (issue 37): a 128K document's follow-up from the host tier and from
# the disk tier read cold, on one GPU, then a restart's reuse; the same for 512K over cp=4 Star
. bench/results/2026-11-28-group-service/prelude.sh
df -T /tmp / 2>/dev/null | tail -n +2
D=/tmp/ss-kv; rm -rf $D
C="$L8B --lengths 131072 --concurrency 1 --cache-gib 24 --disk-cache-dir $D --disk-cache-gib 20 --seed 0"
CUDA_VISIBLE_DEVICES=0 timeout 300 python3 launch/bench.py serve $C --host-cache-gib 20 --tiers host,disk --out $OUT/tiers_1gpu_128k.json > $OUT/all.log 2>&1; t tiers_1gpu
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 launch/bench.py serve $C --reuse-only --out $OUT/reuse_1gpu_128k.json >> $OUT/all.log 2>&1; t reuse_1gpu
rm -rf $D
S=star; D=/tmp/ss-kv-$S; rm -rf $D
C="$L8B --cp 4 --cp-strategy $S --block-size 32768 --anchor-size 32768 --lengths 524288 --concurrency 1 --cache-gib 24 --disk-cache-dir $D --disk-cache-gib 20 --seed 0"
timeout 420 torchrun --nproc-per-node 4 launch/bench.py serve $C --host-cache-gib 20 --tiers host,disk --out $OUT/tiers_star4_512k.json >> $OUT/all.log 2>&1; t tiers_star4
timeout 150 torchrun --nproc-per-node 4 launch/bench.py serve $C --reuse-only --out $OUT/reuse_star4_512k.json >> $OUT/all.log 2>&1; t reuse_star4
rm -rf $D
grep -h "slow step\|Traceback\|Error\|warning\|WARN" $OUT/all.log | head -30
