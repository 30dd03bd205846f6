# Code 86dceff, measured in h100-a/. One call (one GPU), side by side: the service's whole vs default-chunked prefill on three document lengths drawn
# now in [96K, 180K] with serve's default warm-up (GPU idle time between steps, 16 questions' decode against the
# device's step time); bench prefill at the first length (the engine's whole prefill) and at 128K (decode against its
# bytes bound); the parent commit (.base) on the same host: its decode at 128K and its service's warm-up and chunks.
. bench/results/2026-12-06-step-loop/prelude.sh
LENS=$(python3 -c "import random; print(','.join(str(x) for x in sorted(random.sample(range(98304, 180001), 3))))")
L1=${LENS%%,*}; echo "lengths $LENS"
go() { [ $(( $(date +%s) - S )) -lt $1 ]; }  # still before second $1 of the call
D="bench serve $L8B --scenario document --lengths $LENS --cache-gib 30 --decode-tokens 16"
timeout 200 $NEW -m starshard $D --concurrency 1,16 --out $OUT/serve_chunk.json > $OUT/log_sc.txt 2>&1; t serve_chunk
timeout 130 $NEW -m starshard $D --concurrency 1 --prefill-chunk 0 --out $OUT/serve_whole.json > $OUT/log_sw.txt 2>&1; t serve_whole
P="bench prefill $L8B --decode-steps 32 --repeats 2"
go 400 && { timeout 120 $NEW -m starshard $P --lengths $L1,131072 --out $OUT/prefill_new.json > $OUT/log_pn.txt 2>&1; t prefill_new; }
go 470 && { timeout 70 $BASE -m starshard $P --lengths 131072 --repeats 1 --out $OUT/prefill_base.json > $OUT/log_pb.txt 2>&1; t prefill_base; }
go 480 && { timeout 90 $BASE -m starshard bench serve $L8B --scenario document --lengths $L1 --cache-gib 30 --decode-tokens 4 --concurrency 1 --out $OUT/base_serve_chunk.json > $OUT/log_bc.txt 2>&1; t base_serve_chunk; }
cat $OUT/log_*.txt > $OUT/all.log; rm -f $OUT/log_*.txt
grep -h "Traceback\|Error\|slow step" $OUT/all.log | head -20
python3 bench/results/2026-12-06-step-loop/summary.py $OUT
