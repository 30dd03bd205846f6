# call B (one GPU): the parent commit's service (warm-up time, chunks vs whole on one length drawn now), decode
# at 128K profiled (bf16 and --fp8 kv), this tree's bench prefill with --fp8 kv.
. bench/results/2026-12-06-step-loop/prelude.sh
LEN=$(python3 -c "import random; print(random.randrange(98304, 180001))"); echo "length $LEN"
D="bench serve $L8B --scenario document --lengths $LEN --cache-gib 30 --decode-tokens 16 --concurrency 1"
timeout 150 $BASE -m starshard $D --out $OUT/base_serve_chunk.json > $OUT/log_bc.txt 2>&1; t base_serve_chunk
timeout 120 $NEW bench/results/2026-12-06-step-loop/profile_decode.py --out $OUT/decode_prof_bf16.json > $OUT/log_d1.txt 2>&1; t prof_bf16
timeout 120 $NEW bench/results/2026-12-06-step-loop/profile_decode.py --fp8 kv --out $OUT/decode_prof_fp8kv.json > $OUT/log_d2.txt 2>&1; t prof_fp8
cat $OUT/log_*.txt > $OUT/all_b.log; rm $OUT/log_*.txt
grep -h "Traceback\|Error" $OUT/all_b.log | head -20
python3 bench/results/2026-12-06-step-loop/summary.py $OUT
for f in $OUT/decode_prof_*.json; do python3 -c "
import json,sys; d=json.load(open('$f')); print(d['fp8'], d['timing'], 'kernels', round(d['kernels_ms_per_step'],3), {k: d.get(k) for k in ('bytes_bound_s','step_over_bound','copy_read_bytes_per_s','step_over_copy_bound')})
for r in d['kernels'][:8]: print('  ', round(r['ms_per_step'],3), r['calls_per_step'], r['kernel'][:90])"; done
