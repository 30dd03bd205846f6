# call A (one GPU): decode at 128K, parent vs this tree (the KV layout); the service's whole vs default-chunked
# prefill on three document lengths drawn now in [96K, 180K], serve's default warm-up, with the GPU's idle time.
. bench/results/2026-12-06-step-loop/prelude.sh
LENS=$(python3 -c "import random; print(','.join(str(x) for x in sorted(random.sample(range(98304, 180001), 3))))")
echo "lengths $LENS"
P="bench prefill $L8B --lengths 131072 --decode-steps 32 --repeats 2"
timeout 150 $BASE -m starshard $P --out $OUT/prefill_base.json > $OUT/log_pb.txt 2>&1; t prefill_base
timeout 150 $NEW -m starshard $P --out $OUT/prefill_new.json > $OUT/log_pn.txt 2>&1; t prefill_new
D="bench serve $L8B --scenario document --lengths $LENS --cache-gib 30 --decode-tokens 16"
timeout 200 $NEW -m starshard $D --concurrency 1,16 --out $OUT/serve_chunk.json > $OUT/log_sc.txt 2>&1; t serve_chunk
timeout 150 $NEW -m starshard $D --concurrency 1 --prefill-chunk 0 --out $OUT/serve_whole.json > $OUT/log_sw.txt 2>&1; t serve_whole
cat $OUT/log_*.txt > $OUT/all.log; rm $OUT/log_*.txt
grep -h "Traceback\|Error\|slow step" $OUT/all.log | head -20
python3 bench/results/2026-12-06-step-loop/summary.py $OUT
