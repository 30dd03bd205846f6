# 4 GPUs: the service over cp=4 (8 questions vs one, streams during a 512K chunked prefill, cached TTFT over HTTP
# against one GPU of the same machine) and the runner's chunk cost on one GPU after the two-call chunk attention
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
L8B="--random-weights llama-3.1-8b"
S=$(date +%s); t() { echo "rc=$? t=$(( $(date +%s)-S )) $1"; }
CUDA_VISIBLE_DEVICES=1 timeout 170 python3 bench/results/2026-11-28-service-load/chunk_cost.py 131072 $OUT/chunk_cost.json > $OUT/chunk_cost.log 2>&1 &
CC=$!
HTTPQ="--scenario load --num-prompts 12 --max-concurrency 1 --num-docs 1 --doc-len-dist fixed:131072 --follow-up-ratio 0.95 --question-len 64 --output-len 8 --seed 1"
waitup() { for i in $(seq 120); do curl -sf http://127.0.0.1:$1/health >/dev/null && return 0; sleep 1; done; return 1; }
CUDA_VISIBLE_DEVICES=0 python3 launch/serve.py $L8B --cache-gib 30 --port 8001 --log-level warning >> $OUT/all.log 2>&1 &
SP=$!; waitup 8001; t up1
timeout 90 python3 launch/bench.py serve $HTTPQ --url http://127.0.0.1:8001 --out $OUT/http_1gpu.json >> $OUT/all.log 2>&1; t http1
kill $SP; wait $SP; wait $CC; t chunk_cost
timeout 150 torchrun --nproc-per-node 4 launch/bench.py serve $L8B --scenario document --cp 4 --cp-strategy star --lengths 131072 --concurrency 1,8 --decode-tokens 64 --cache-gib 40 --out $OUT/doc_cp4.json >> $OUT/all.log 2>&1; t doc_cp4
timeout 170 torchrun --nproc-per-node 4 launch/bench.py serve $L8B --scenario load --cp 4 --cp-strategy ring --cache-gib 40 --num-prompts 40 --max-concurrency 8 --num-docs 2 --doc-len-dist list:2048,524288 --follow-up-ratio 0.9 --question-len 64 --output-len 128 --request-timeout 600 --out $OUT/nostall_cp4.json >> $OUT/all.log 2>&1; t nostall_cp4
torchrun --nproc-per-node 4 launch/serve.py $L8B --cp 4 --cp-strategy star --cache-gib 40 --port 8004 --log-level warning >> $OUT/all.log 2>&1 &
SP=$!; waitup 8004; t up4
timeout 90 python3 launch/bench.py serve $HTTPQ --url http://127.0.0.1:8004 --out $OUT/http_cp4.json >> $OUT/all.log 2>&1; t http4
kill $SP; wait $SP
grep -h "slow step" $OUT/all.log | head -20
