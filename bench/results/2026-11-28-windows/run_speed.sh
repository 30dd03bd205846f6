# Issue 38's speed and bytes targets in one call of a 4-GPU machine (random weights, bf16, 131072 tokens):
#   1. one GPU: gemma-3-4b with its windows (local layers' KV trimmed) against the same weights with every
#      layer global, side by side in one process (bench prefill --all-global): speedup over the FLOP model's
#      prediction (target >= 0.85) and the planner's KV per token against all-global (target <= 0.30);
#   2. four GPUs, cp=4 ring: the K/V bytes per local layer against per global layer (target <= 0.10), and the
#      same side-by-side speedup over the ring.
# Estimate (H200): 4B all-global prefill ~3.2 PFLOP (0.84 linear + 2.39 attention; D=256 runs the Triton flash
# kernel) ~8-10 s, windowed ~1.2 PFLOP ~3 s; part 1 ~ 25 s start + Triton compile + 3 x (3 + 10) s ~ 1.5 min,
# part 2 ~ 30 s start + 2 x (1 + 3) s ~ 1 min; about 3 min in all.
. bench/results/2026-11-28-group-service/prelude.sh
G4B="--random-weights gemma-3-4b --dtype bfloat16 --lengths 131072 --decode-steps 0 --all-global"
CUDA_VISIBLE_DEVICES=0 timeout 300 python3 launch/bench.py prefill $G4B --cp-strategy dense --warmup 1 --repeats 2 \
    --out $OUT/gemma3_4b_1gpu.json > $OUT/all.log 2>&1; t speed_1gpu
timeout 200 torchrun --nproc-per-node 4 launch/bench.py prefill $G4B --cp 4 --cp-strategy ring --warmup 1 --repeats 1 \
    --out $OUT/gemma3_4b_ring4.json >> $OUT/all.log 2>&1; t ring4
python3 bench/results/2026-11-28-windows/summary.py $OUT/gemma3_4b_1gpu.json $OUT/gemma3_4b_ring4.json
grep -h "Traceback\|Error\|error:" $OUT/all.log | head -20
