#!/usr/bin/env bash
# Third 2 x H200 call: decode after routing short query blocks to the flash kernel.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LOG=$OUT/run3.log
step() { echo "=== $* ($(date +%T))" | tee -a "$LOG"; timeout "${T:-300}" "$@" >>"$LOG" 2>&1; echo "rc=$?" | tee -a "$LOG"; }
L8B="--random-weights llama-3.1-8b"
T=100 step python3 launch/gpu_check.py
T=200 step python3 launch/bench.py prefill $L8B --cp-strategy dense --lengths 8192,131072 --repeats 2 --decode-steps 64 --out "$OUT/decode_dense_1gpu.json"
T=150 step torchrun --nproc-per-node 2 launch/bench.py prefill $L8B --cp 2 --cp-strategy ring --lengths 131072 --repeats 2 --decode-steps 64 --out "$OUT/decode_ring_cp2.json"
grep -h '"ok": false' "$LOG" | head -20
grep -h '"decode"' "$LOG" | cut -c1-400
