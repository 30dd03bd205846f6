# Ran at 280d734: "the fix" is kernels/attention.py `_own_strides`, dropped after this call in c9f3135 (docs/results.md, Service):
# the "before" run below is the code that shipped.
# call F (2 GPUs of one host): the document scenario's chunk cost with and without _own_strides side by side
# (the fix's share at 32 layers; call D measured 1.07x with it, earlier calls 1.16-1.22x without it on other hosts).
# GPU 0: tapered 4096 with the fix, then whole; GPU 1: tapered 4096 with cuDNN handed the cache's views as they
# are (the patched-out helper, as profile_prefill.py --no-own-strides).
. bench/results/2026-11-28-group-service/prelude.sh
DOC="$L8B --scenario document --lengths 131072,131073,131074 --concurrency 1 --decode-tokens 16 --cache-gib 30 --warmup-tokens 131200"
BEFORE="import runpy, sys, starshard.kernels.attention as a; a._own_strides = lambda x: x; sys.argv = ['launch/bench.py'] + sys.argv[1:]; runpy.run_path('launch/bench.py', run_name='__main__')"
( CUDA_VISIBLE_DEVICES=0 timeout 200 python3 launch/bench.py serve $DOC --out $OUT/doc_taper.json > $OUT/log0.txt 2>&1
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 launch/bench.py serve $DOC --prefill-chunk 0 --out $OUT/doc_whole.json > $OUT/log1.txt 2>&1 ) &
CUDA_VISIBLE_DEVICES=1 timeout 200 python3 -c "$BEFORE" serve $DOC --out $OUT/doc_taper_before.json > $OUT/log2.txt 2>&1 &
wait; t done
cat $OUT/log*.txt > $OUT/all.log; rm $OUT/log*.txt
grep -h "slow step\|Traceback\|Error" $OUT/all.log | head -20
python3 - $OUT <<'PY'
import json, sys, pathlib
o = pathlib.Path(sys.argv[1])
for n in ("doc_whole.json", "doc_taper.json", "doc_taper_before.json"):
    p = o / n
    if p.exists():
        d = json.loads(p.read_text())
        print(n, round(d.get("warmup_s") or 0, 1), [(r.get("length"), round(r.get("ttft_uncached_s"), 3)) for r in d["results"]])
PY
