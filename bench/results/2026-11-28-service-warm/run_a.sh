# call A (4 GPUs; Gemma chunk 1 of 4 rides along): issue 36 with the start-up warm-up (serving/warmup.py).
# 1. alone on the host: other streams' gaps while a 128K document prefills on one GPU (tapered chunks, serve's default);
# 2. at once, one job per GPU: the 128K prefill whole vs tapered (two documents each: 131072 and 131073 tokens, the
#    second a new document on a warm process), and issue 38's Gemma 3 4B windows vs all-global at 128K (one GPU).
. bench/results/2026-11-28-group-service/prelude.sh
LOAD="--scenario load $L8B --cache-gib 30 --num-prompts 64 --max-concurrency 8 --num-docs 2 --doc-len-dist list:2048,131072 --follow-up-ratio 0.9 --question-len 64 --output-len 128 --request-timeout 600 --warmup-tokens 131200"
DOC="$L8B --scenario document --lengths 131072,131073 --concurrency 1 --decode-tokens 16 --cache-gib 30 --warmup-tokens 131200"
G4B="--random-weights gemma-3-4b --dtype bfloat16 --lengths 131072 --decode-steps 0 --all-global"
CUDA_VISIBLE_DEVICES=0 timeout 240 python3 launch/bench.py serve $LOAD --save-detailed --out $OUT/nostall_1gpu.json > $OUT/log0.txt 2>&1; t nostall_1gpu
CUDA_VISIBLE_DEVICES=0 timeout 240 python3 launch/bench.py serve $DOC --prefill-chunk 0 --out $OUT/doc_whole.json > $OUT/log1.txt 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout 240 python3 launch/bench.py serve $DOC --out $OUT/doc_taper.json > $OUT/log2.txt 2>&1 &
CUDA_VISIBLE_DEVICES=2 timeout 240 python3 launch/bench.py prefill $G4B --cp-strategy dense --warmup 1 --repeats 2 --out $OUT/gemma3_4b_1gpu.json > $OUT/log3.txt 2>&1 &
wait; t doc_speed
cat $OUT/log*.txt > $OUT/all.log; rm $OUT/log*.txt
grep -h "warm-up\|slow step\|Traceback\|Error" $OUT/all.log | head -30
python3 - $OUT <<'PY'
import json, sys, pathlib
o = pathlib.Path(sys.argv[1])
def get(n):
    p = o / n
    return json.loads(p.read_text()) if p.exists() else None
d = get("nostall_1gpu.json")
if d: print("nostall", json.dumps({k: d.get(k) for k in ("warmup_s", "itl_during_new_doc_prefill", "p99_itl_ms", "completed", "failed", "lost")})[:1500])
for n in ("doc_whole.json", "doc_taper.json"):
    d = get(n)
    if d: print(n, d.get("warmup_s"), [(r.get("length"), r.get("ttft_uncached_s", r.get("uncached_ttft_s"))) for r in d.get("results", d.get("rows", []))])
PY
python3 bench/results/2026-11-28-windows/summary.py $OUT/gemma3_4b_1gpu.json 2>&1 | tail -20
