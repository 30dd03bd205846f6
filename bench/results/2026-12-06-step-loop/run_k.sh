# One call (one GPU), code e608f43, as measured in h100-c/: cuDNN's plan build per K/V and Q layout; the service's
# whole vs default-chunked prefill on three lengths drawn now in [96K, 180K] with serve's default warm-up (idle time
# between steps, 16 questions' decode against the device's step time); the parent's chunked prefill at the first
# length; bench prefill at the first length; other streams' gaps during a 128K prefill (load scenario).
. bench/results/2026-12-06-step-loop/prelude.sh
go() { [ $(( $(date +%s) - S )) -lt $1 ]; }
timeout 60 $NEW bench/results/2026-12-06-step-loop/cudnn_plans.py $OUT/cudnn.json > $OUT/cudnn.txt 2>&1; t cudnn
LENS=$(python3 -c "import random; print(','.join(str(x) for x in sorted(random.sample(range(98304, 180001), 3))))")
L1=${LENS%%,*}; echo "lengths $LENS"

D="bench serve $L8B --scenario document --lengths $LENS --cache-gib 30 --decode-tokens 16"
timeout 170 $NEW -m starshard $D --concurrency 1,16 --out $OUT/serve_chunk.json > $OUT/log_sc.txt 2>&1; t serve_chunk
timeout 110 $NEW -m starshard $D --concurrency 1 --prefill-chunk 0 --out $OUT/serve_whole.json > $OUT/log_sw.txt 2>&1; t serve_whole
go 300 && { timeout 60 $BASE -m starshard bench serve $L8B --scenario document --lengths $L1 --cache-gib 30 --decode-tokens 4 --concurrency 1 --out $OUT/base_serve_chunk.json > $OUT/log_bc.txt 2>&1; t base_serve_chunk; }
go 330 && { timeout 60 $NEW -m starshard bench prefill $L8B --lengths $L1 --repeats 1 --out $OUT/prefill_new.json > $OUT/log_pn.txt 2>&1; t prefill_new; }
LOAD="--scenario load $L8B --cache-gib 30 --num-prompts 64 --max-concurrency 8 --num-docs 2 --doc-len-dist list:2048,131072 --follow-up-ratio 0.9 --question-len 64 --output-len 128 --request-timeout 600"
go 340 && { timeout 125 $NEW -m starshard bench serve $LOAD --out $OUT/load_new.json > $OUT/log_ld.txt 2>&1; t load_new; }
cat $OUT/log_*.txt > $OUT/all.log; rm -f $OUT/log_*.txt
grep -h "Traceback\|Error\|slow step" $OUT/all.log | head -20
python3 bench/results/2026-12-06-step-loop/summary.py $OUT
python3 -c "
import json; d=json.load(open('$OUT/load_new.json')); print({k: v for k, v in d.items() if 'itl_during' in k or k in ('completed','failed','lost','warmup_s')})" 2>&1 | tail -3
