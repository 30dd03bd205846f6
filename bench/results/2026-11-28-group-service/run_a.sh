# call A (4 GPUs): run5's '969' cause (is CC in the environment?), cuDNN's per-shape cost for a chunk's held
# prefix, one GPU's streams during a 128K prefill at serve's default chunk, and a cached follow-up's TTFT over
# HTTP on one GPU and on cp=4 Star of the same machine (one after the other, never two GPU jobs at once)
. bench/results/2026-11-28-group-service/prelude.sh
echo "CC=${CC-unset} CXX=${CXX-unset}"
timeout 100 python3 .probe/cudnn_shapes.py $OUT/cudnn_shapes.json > $OUT/all.log 2>&1; t probe
LOAD="--scenario load $L8B --cache-gib 30 --num-prompts 64 --max-concurrency 8 --num-docs 2 --doc-len-dist list:2048,131072 --follow-up-ratio 0.9 --question-len 64 --output-len 128 --request-timeout 600"
CUDA_VISIBLE_DEVICES=0 timeout 170 python3 launch/bench.py serve $LOAD --out $OUT/nostall_1gpu.json >> $OUT/all.log 2>&1; t nostall_1gpu
HTTPQ="--scenario load --num-prompts 12 --max-concurrency 1 --num-docs 1 --doc-len-dist fixed:131072 --follow-up-ratio 0.95 --question-len 64 --output-len 8 --seed 1"
CUDA_VISIBLE_DEVICES=0 python3 launch/serve.py $L8B --cache-gib 30 --port 8001 --log-level warning >> $OUT/all.log 2>&1 &
SP=$!; waitup 8001; t up1
timeout 90 python3 launch/bench.py serve $HTTPQ --url http://127.0.0.1:8001 --out $OUT/http_1gpu.json >> $OUT/all.log 2>&1; t http_1gpu
kill $SP; wait $SP
torchrun --nproc-per-node 4 launch/serve.py $L8B --cp 4 --cp-strategy star --cache-gib 40 --port 8004 --log-level warning >> $OUT/all.log 2>&1 &
SP=$!; waitup 8004; t up4
timeout 90 python3 launch/bench.py serve $HTTPQ --url http://127.0.0.1:8004 --out $OUT/http_cp4.json >> $OUT/all.log 2>&1; t http_cp4
kill $SP; wait $SP
grep -h "slow step\|Traceback\|Error" $OUT/all.log | head -30
