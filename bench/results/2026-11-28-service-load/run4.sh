# one GPU: chunk cost at the runner, streams while a 128K document prefills (chunked vs whole), a lossless HTTP load
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
L8B="--random-weights llama-3.1-8b"
S=$(date +%s); t() { echo "rc=$? t=$(( $(date +%s)-S ))"; }
timeout 150 python3 bench/results/2026-11-28-service-load/chunk_cost.py 131072 $OUT/chunk_cost.json >> $OUT/all.log 2>&1; t
LOAD="--scenario load $L8B --cache-gib 30 --num-prompts 48 --max-concurrency 8 --num-docs 2 --doc-len-dist list:2048,131072 --follow-up-ratio 0.9 --question-len 64 --output-len 128 --request-timeout 600"
for C in 2048 0; do
  timeout 100 python3 launch/bench.py serve $LOAD --prefill-chunk $C --out $OUT/nostall_c$C.json >> $OUT/all.log 2>&1; t
done
python3 launch/serve.py $L8B --cache-gib 30 --port 8000 --log-level warning >> $OUT/all.log 2>&1 &
SP=$!
for i in $(seq 90); do curl -sf http://127.0.0.1:8000/health >/dev/null && break; sleep 1; done; t
timeout 240 python3 launch/bench.py serve --scenario load --url http://127.0.0.1:8000 --num-prompts 300 --max-concurrency 8 --num-docs 4 --doc-len-dist fixed:16384 --follow-up-ratio 0.9 --question-len 64 --output-len 64 --cancel-ratio 0.05 --cancel-after 8 --request-timeout 600 --out $OUT/lost_http.json >> $OUT/all.log 2>&1; t
curl -s http://127.0.0.1:8000/health; echo
kill $SP; wait $SP
