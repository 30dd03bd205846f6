# call C (4 GPUs; Gemma chunk 1 of 4): issue 36 with 8192-token chunks on one GPU (knee = the model's): alone on the
# host, the gaps during a 128K prefill; then the 128K prefill whole vs in 8192-token tapered chunks, side by side
# (two documents each, one job per GPU); then 512K over cp=4 ring with serve's CP default (4096 x cp, knee x cp).
. bench/results/2026-11-28-group-service/prelude.sh
LOAD="--scenario load $L8B --cache-gib 30 --num-prompts 64 --max-concurrency 8 --num-docs 2 --doc-len-dist list:2048,131072 --follow-up-ratio 0.9 --question-len 64 --output-len 128 --request-timeout 600 --warmup-tokens 131200"
DOC="$L8B --scenario document --lengths 131072,131073 --concurrency 1 --decode-tokens 16 --cache-gib 30 --warmup-tokens 131200"
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 launch/bench.py serve $LOAD --prefill-chunk 8192 --save-detailed --out $OUT/nostall_1gpu_c8192.json > $OUT/log0.txt 2>&1; t nostall_c8192
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 launch/bench.py serve $DOC --prefill-chunk 0 --out $OUT/doc_whole.json > $OUT/log1.txt 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout 150 python3 launch/bench.py serve $DOC --prefill-chunk 8192 --out $OUT/doc_c8192.json > $OUT/log2.txt 2>&1 &
CUDA_VISIBLE_DEVICES=2 timeout 150 python3 launch/bench.py serve $DOC --prefill-chunk 4096 --out $OUT/doc_c4096.json > $OUT/log3.txt 2>&1 &
wait; t docs
timeout 240 torchrun --nproc-per-node 4 launch/bench.py serve $L8B --scenario load --cp 4 --cp-strategy ring --cache-gib 40 --num-prompts 40 --max-concurrency 8 --num-docs 2 --doc-len-dist list:2048,524288 --follow-up-ratio 0.9 --question-len 64 --output-len 128 --request-timeout 600 --warmup-tokens 524480 --save-detailed --out $OUT/nostall_cp4.json > $OUT/log4.txt 2>&1; t nostall_cp4
cat $OUT/log*.txt > $OUT/all.log; rm $OUT/log*.txt
grep -h "warm-up:\|slow step\|Traceback\|Error" $OUT/all.log | head -20
python3 - $OUT <<'PY'
import json, sys, pathlib
o = pathlib.Path(sys.argv[1])
for n in ("nostall_1gpu_c8192.json", "nostall_cp4.json"):
    p = o / n
    if p.exists():
        d = json.loads(p.read_text()); print(n, json.dumps({k: d.get(k) for k in ("warmup_s", "itl_during_new_doc_prefill", "completed", "failed", "lost")}))
for n in ("doc_whole.json", "doc_c8192.json", "doc_c4096.json"):
    p = o / n
    if p.exists():
        d = json.loads(p.read_text()); print(n, d.get("warmup_s"), [(r.get("length"), r.get("ttft_uncached_s")) for r in d.get("results", [])])
PY
