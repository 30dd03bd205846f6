# One call (one GPU), side by side: the service's whole vs default-chunked prefill on three document lengths drawn
# now in [96K, 120K] with serve's default warm-up (the GPU's idle time between steps; 16 questions' decode against
# the device's step time), then bench prefill at the first length (the engine's whole prefill). Cut from run_c.sh
# to fit the device time that was left.
. bench/results/2026-12-06-step-loop/prelude.sh
LENS=$(python3 -c "import random; print(','.join(str(x) for x in sorted(random.sample(range(98304, 122881), 3))))")
L1=${LENS%%,*}; echo "lengths $LENS"
D="bench serve $L8B --scenario document --lengths $LENS --cache-gib 30 --decode-tokens 16"
timeout 130 $NEW -m starshard $D --concurrency 1,16 --out $OUT/serve_chunk.json > $OUT/log_sc.txt 2>&1; t serve_chunk
timeout 90 $NEW -m starshard $D --concurrency 1 --prefill-chunk 0 --out $OUT/serve_whole.json > $OUT/log_sw.txt 2>&1; t serve_whole
timeout 70 $NEW -m starshard bench prefill $L8B --repeats 1 --lengths $L1 --out $OUT/prefill_new.json > $OUT/log_pn.txt 2>&1; t prefill_new
cat $OUT/log_*.txt > $OUT/all.log; rm -f $OUT/log_*.txt
grep -h "Traceback\|Error\|slow step" $OUT/all.log | head -20
python3 bench/results/2026-12-06-step-loop/summary.py $OUT
