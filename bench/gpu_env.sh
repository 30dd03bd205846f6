# Sourced by the device-run scripts: NCCL/NVLink-multicast safety knobs, the carried megatron-core
# wheel, $OUT and a `step` helper that logs and time-limits each command. Set LOG before sourcing.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LOG=$OUT/$LOG
step() { echo "=== $* ($(date +%T))" | tee -a "$LOG"; timeout "${T:-300}" "$@" >>"$LOG" 2>&1; echo "rc=$?" | tee -a "$LOG"; }
L8B="--random-weights llama-3.1-8b"
