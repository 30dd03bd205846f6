# call B (4 GPUs): 8 concurrent questions vs one on a cached 128K document over cp=4 Star (batched admission),
# and the other streams while a 512K document prefills over cp=4 ring (serve's default chunk, 4096 x cp)
. bench/results/2026-11-28-group-service/prelude.sh
timeout 200 torchrun --nproc-per-node 4 launch/bench.py serve $L8B --scenario document --cp 4 --cp-strategy star --lengths 131072 --concurrency 1,8 --decode-tokens 64 --cache-gib 40 --out $OUT/doc_cp4.json > $OUT/all.log 2>&1; t doc_cp4
timeout 300 torchrun --nproc-per-node 4 launch/bench.py serve $L8B --scenario load --cp 4 --cp-strategy ring --cache-gib 40 --num-prompts 40 --max-concurrency 8 --num-docs 2 --doc-len-dist list:2048,524288 --follow-up-ratio 0.9 --question-len 64 --output-len 128 --request-timeout 600 --prefill-chunk 16384 --out $OUT/nostall_cp4.json >> $OUT/all.log 2>&1; t nostall_cp4
grep -h "slow step\|Traceback\|Error" $OUT/all.log | head -30
LOAD="--scenario load $L8B --cache-gib 30 --num-prompts 64 --max-concurrency 8 --num-docs 2 --doc-len-dist list:2048,131072 --follow-up-ratio 0.9 --question-len 64 --output-len 128 --request-timeout 600"
CUDA_VISIBLE_DEVICES=0 timeout 170 python3 launch/bench.py serve $LOAD --prefill-chunk 4096 --out $OUT/nostall_1gpu_c4096.json >> $OUT/all.log 2>&1; t nostall_1gpu_c4096
grep -h "slow step\|Traceback\|Error" $OUT/all.log | tail -12
