# call E (4 GPUs): the other streams while a 512K document prefills over cp=4 ring in tapered chunks (serve's
# default: 16384 tokens, knee = the model's x cp) with the held prefix unmasked (Gemma chunk 2 of 4 rides along)
. bench/results/2026-11-28-group-service/prelude.sh
timeout 300 torchrun --nproc-per-node 4 launch/bench.py serve $L8B --scenario load --cp 4 --cp-strategy ring --cache-gib 40 --num-prompts 40 --max-concurrency 8 --num-docs 2 --doc-len-dist list:2048,524288 --follow-up-ratio 0.9 --question-len 64 --output-len 128 --request-timeout 600 --save-detailed --out $OUT/nostall_cp4_taper.json > $OUT/all.log 2>&1; t nostall_cp4
grep -h "slow step\|Traceback\|Error" $OUT/all.log | head -40
