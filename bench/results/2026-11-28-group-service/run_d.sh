# call D (4 GPUs, one 1-GPU job per GPU at once): streams during a 128K prefill with the tapered chunks (serve's
# default) and with uniform 4096-token chunks, and the 128K prefill's time whole vs tapered (Gemma chunk 1 of 4 rides along)
. bench/results/2026-11-28-group-service/prelude.sh
LOAD="--scenario load $L8B --cache-gib 30 --num-prompts 64 --max-concurrency 8 --num-docs 2 --doc-len-dist list:2048,131072 --follow-up-ratio 0.9 --question-len 64 --output-len 128 --request-timeout 600"
DOC="$L8B --scenario document --lengths 131072 --concurrency 1 --decode-tokens 16 --cache-gib 30"
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 launch/bench.py serve $LOAD --out $OUT/nostall_taper.json > $OUT/log0.txt 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout 200 python3 launch/bench.py serve $LOAD --no-prefill-taper --out $OUT/nostall_uniform.json > $OUT/log1.txt 2>&1 &
CUDA_VISIBLE_DEVICES=2 timeout 200 python3 launch/bench.py serve $DOC --prefill-chunk 0 --out $OUT/doc_whole.json > $OUT/log2.txt 2>&1 &
CUDA_VISIBLE_DEVICES=3 timeout 200 python3 launch/bench.py serve $DOC --out $OUT/doc_taper.json > $OUT/log3.txt 2>&1 &
wait; t all
cat $OUT/log*.txt > $OUT/all.log; rm $OUT/log*.txt
grep -h "slow step\|Traceback\|Error" $OUT/all.log | head -30
