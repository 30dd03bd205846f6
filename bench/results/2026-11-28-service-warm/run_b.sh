# call B (4 GPUs; Gemma chunk 2 of 4 rides along): issue 36, the taper's knee at 2x the model's (53248) alone on the
# host (gaps during a 128K prefill), then the 128K prefill's cost with that knee and with 8192-token chunks (two
# documents each, one job per GPU); issue 38, Gemma 3 4B over cp=4 ring (K/V bytes local vs global); issue 37,
# 512K over cp=4 ring: the host tier's follow-up against the prefill.
. bench/results/2026-11-28-group-service/prelude.sh
LOAD="--scenario load $L8B --cache-gib 30 --num-prompts 64 --max-concurrency 8 --num-docs 2 --doc-len-dist list:2048,131072 --follow-up-ratio 0.9 --question-len 64 --output-len 128 --request-timeout 600 --warmup-tokens 131200"
DOC="$L8B --scenario document --lengths 131072,131073 --concurrency 1 --decode-tokens 16 --cache-gib 30 --warmup-tokens 131200"
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 launch/bench.py serve $LOAD --prefill-knee 53248 --save-detailed --out $OUT/nostall_1gpu_knee2.json > $OUT/log0.txt 2>&1; t nostall_knee2
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 launch/bench.py serve $DOC --prefill-knee 53248 --out $OUT/doc_knee2.json > $OUT/log1.txt 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout 200 python3 launch/bench.py serve $DOC --prefill-chunk 8192 --out $OUT/doc_c8192.json > $OUT/log2.txt 2>&1 &
CUDA_VISIBLE_DEVICES=2 timeout 200 python3 launch/bench.py serve $DOC --prefill-chunk 8192 --prefill-knee 53248 --out $OUT/doc_c8192_knee2.json > $OUT/log3.txt 2>&1 &
wait; t docs
G4B="--random-weights gemma-3-4b --dtype bfloat16 --lengths 131072 --decode-steps 0 --all-global"
timeout 150 torchrun --nproc-per-node 4 launch/bench.py prefill $G4B --cp 4 --cp-strategy ring --warmup 1 --repeats 1 --out $OUT/gemma3_4b_ring4.json > $OUT/log4.txt 2>&1; t ring4_bytes
timeout 200 torchrun --nproc-per-node 4 launch/bench.py serve $L8B --cp 4 --cp-strategy ring --lengths 524288 --concurrency 1 --cache-gib 24 --host-cache-gib 20 --tiers host --no-warmup --out $OUT/tiers_ring4_512k.json > $OUT/log5.txt 2>&1; t tiers_ring4
cat $OUT/log*.txt > $OUT/all.log; rm $OUT/log*.txt
grep -h "warm-up:\|slow step\|Traceback\|Error" $OUT/all.log | head -30
python3 - $OUT <<'PY'
import json, sys, pathlib
o = pathlib.Path(sys.argv[1])
def get(n):
    p = o / n
    return json.loads(p.read_text()) if p.exists() else None
d = get("nostall_1gpu_knee2.json")
if d: print("nostall_knee2", json.dumps({k: d.get(k) for k in ("warmup_s", "itl_during_new_doc_prefill", "completed", "failed", "lost")}))
for n in ("doc_knee2.json", "doc_c8192.json", "doc_c8192_knee2.json"):
    d = get(n)
    if d: print(n, d.get("warmup_s"), [(r.get("length"), r.get("ttft_uncached_s")) for r in d.get("results", [])])
d = get("tiers_ring4_512k.json")
if d:
    for r in d.get("results", []): print({k: v for k, v in r.items() if "ttft" in k or "over" in k or k == "length" or "demote" in k})
PY
python3 bench/results/2026-11-28-windows/summary.py $OUT/gemma3_4b_ring4.json 2>&1 | tail -12
