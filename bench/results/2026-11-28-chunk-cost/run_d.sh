# Ran at 85d5cbf with kernels/attention.py `_own_strides` (cuDNN handed KV-cache views copied to their shape's own
# strides) and profile_prefill.py `--no-own-strides`; both were dropped after call F (docs/results.md, Service).
# call D (2 GPUs of one host): issue 36's chunk cost with kernels/attention.py _own_strides (cuDNN gets KV-cache
# views with strides set by their shape, not the cache's capacity, so its graph cache hits across documents).
# GPU 0: the 128K document scenario whole, then the load (other streams' gaps while a 128K document prefills);
# GPU 1: the document scenario in serve's default tapered 4096-token chunks, then the 4-layer A/B of the fix
# (bench/profile_prefill.py --service --vary-length, with and without --no-own-strides) - all one call.
. bench/results/2026-11-28-group-service/prelude.sh
mkdir -p /tmp/smol && cp .s1/* /tmp/smol/ 2>/dev/null  # SmolLM2's first half for the next call (issue 38)
LOAD="--scenario load $L8B --cache-gib 30 --num-prompts 64 --max-concurrency 8 --num-docs 2 --doc-len-dist list:2048,131072 --follow-up-ratio 0.9 --question-len 64 --output-len 128 --request-timeout 600 --warmup-tokens 131200"
DOC="$L8B --scenario document --lengths 131072,131073 --concurrency 1 --decode-tokens 16 --cache-gib 30 --warmup-tokens 131200"
P4="python3 bench/profile_prefill.py --layers 4 --prompt-len 131072 --repeats 3 --service --vary-length"
( CUDA_VISIBLE_DEVICES=0 timeout 240 python3 launch/bench.py serve $DOC --prefill-chunk 0 --out $OUT/doc_whole.json > $OUT/log0.txt 2>&1
  CUDA_VISIBLE_DEVICES=0 timeout 300 python3 launch/bench.py serve $LOAD --out $OUT/nostall_1gpu.json > $OUT/log1.txt 2>&1 ) &
( CUDA_VISIBLE_DEVICES=1 timeout 240 python3 launch/bench.py serve $DOC --out $OUT/doc_taper.json > $OUT/log2.txt 2>&1
  export CUDA_VISIBLE_DEVICES=1
  $P4 --prefill-chunk 4096 --prefill-knee 26624 --out $OUT/p4_taper.json 2>&1 | grep "^prefill" > $OUT/log3.txt
  $P4 --prefill-chunk 4096 --prefill-knee 26624 --no-own-strides --out $OUT/p4_taper_before.json 2>&1 | grep "^prefill" >> $OUT/log3.txt
  $P4 --out $OUT/p4_whole.json 2>&1 | grep "^prefill" >> $OUT/log3.txt ) &
wait; t done
cat $OUT/log3.txt
cat $OUT/log0.txt $OUT/log1.txt $OUT/log2.txt > $OUT/all.log; rm $OUT/log*.txt
grep -h "warm-up\|slow step\|Traceback\|Error" $OUT/all.log | head -20
python3 - $OUT <<'PY'
import json, sys, pathlib
o = pathlib.Path(sys.argv[1])
def get(n):
    p = o / n
    return json.loads(p.read_text()) if p.exists() else None
d = get("nostall_1gpu.json")
if d: print("nostall", json.dumps({k: d.get(k) for k in ("warmup_s", "itl_during_new_doc_prefill", "completed", "failed", "lost")})[:1200])
for n in ("doc_whole.json", "doc_taper.json"):
    d = get(n)
    if d: print(n, d.get("warmup_s"), [(r.get("length"), r.get("ttft_uncached_s")) for r in d.get("results", d.get("rows", []))])
PY
