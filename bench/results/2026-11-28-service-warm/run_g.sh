# call G (4 GPUs, one job per GPU at once): issue 36 with 6144-token chunks (knee = the model's): gaps during a 128K
# prefill, beside serve's 4096 default again (a control: does the neighbours' load move the p99 of call A, alone?),
# and the 128K prefill whole vs in 6144-token tapered chunks (two documents each).
. bench/results/2026-11-28-group-service/prelude.sh
LOAD="--scenario load $L8B --cache-gib 30 --num-prompts 64 --max-concurrency 8 --num-docs 2 --doc-len-dist list:2048,131072 --follow-up-ratio 0.9 --question-len 64 --output-len 128 --request-timeout 600 --warmup-tokens 131200"
DOC="$L8B --scenario document --lengths 131072,131073 --concurrency 1 --decode-tokens 16 --cache-gib 30 --warmup-tokens 131200"
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 launch/bench.py serve $LOAD --prefill-chunk 6144 --save-detailed --out $OUT/nostall_1gpu_c6144.json > $OUT/log0.txt 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout 150 python3 launch/bench.py serve $LOAD --save-detailed --out $OUT/nostall_1gpu_c4096.json > $OUT/log1.txt 2>&1 &
CUDA_VISIBLE_DEVICES=2 timeout 150 python3 launch/bench.py serve $DOC --prefill-chunk 0 --out $OUT/doc_whole.json > $OUT/log2.txt 2>&1 &
CUDA_VISIBLE_DEVICES=3 timeout 150 python3 launch/bench.py serve $DOC --prefill-chunk 6144 --out $OUT/doc_c6144.json > $OUT/log3.txt 2>&1 &
wait; t all
cat $OUT/log*.txt > $OUT/all.log; rm $OUT/log*.txt
python3 - $OUT <<'PY'
import json, sys, pathlib
o = pathlib.Path(sys.argv[1])
for n in ("nostall_1gpu_c6144.json", "nostall_1gpu_c4096.json"):
    p = o / n
    if p.exists():
        d = json.loads(p.read_text()); print(n, json.dumps({k: d.get(k) for k in ("warmup_s", "itl_during_new_doc_prefill", "completed", "failed", "lost")}))
for n in ("doc_whole.json", "doc_c6144.json"):
    p = o / n
    if p.exists():
        d = json.loads(p.read_text()); print(n, d.get("warmup_s"), [(r.get("length"), r.get("ttft_uncached_s")) for r in d.get("results", [])])
PY
