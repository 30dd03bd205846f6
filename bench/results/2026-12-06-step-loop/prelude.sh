# sourced by each call of this run: the device's environment, the carried wheels, the parent commit's tree
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
[ -d /tmp/site/opentelemetry ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
NEW="env PYTHONPATH=/tmp/site:$PWD python3"
# .base: `git archive 2f17e11 starshard launch` (the parent commit). -P: `python -m` otherwise puts the working
# directory (this tree) first on sys.path: the "parent" of h100-d/, h100-e/ and h100-f/ ran this tree (their
# JSONs carry its fields)
BASE="env PYTHONPATH=/tmp/site:$PWD/.base python3 -P"
[ -d .base ] && $BASE -c "import starshard; print('the parent runs', starshard.__file__)"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
L8B="--random-weights llama-3.1-8b"
# S: the call's start (CALL_START=$(date +%s) exported before the first script of a call makes later scripts'
# budgets, e.g. search_pair.sh's END, count from it), else this script's
S=${CALL_START:-$(date +%s)}; t() { echo "rc=$? t=$(( $(date +%s)-S )) $1"; }
