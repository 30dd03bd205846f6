#!/usr/bin/env bash
# APB accuracy vs Star vs dense, with the APB paper's ablations, on ONE device: APB runs in study mode
# (--cp-strategy apb --apb-hosts HOSTS) and Star with --num-blocks HOSTS, each reproducing cp = HOSTS
# exactly, the hosts' blocks run one after another.
#
#   DEVICE=cuda LENGTHS=2048,4096,8192 HOSTS=4 SAMPLES=4 bash bench/apb_ablation.sh
#   DEVICE=cpu LENGTHS=1024 HOSTS=4 SAMPLES=1 TASKS=passkey bash bench/apb_ablation.sh   # CPU smoke
#
# Environment (all optional):
#   DEVICE   cpu | cuda (default: cuda if torch sees one)
#   LENGTHS  comma-separated sequence lengths in model tokens (default 2048,4096,8192)
#   HOSTS    hosts APB and Star split the context over (default 4)
#   SAMPLES  samples per (task, length, depth) cell (default 2)
#   TASKS    comma-separated tasks (default: launch/eval.py's default, all)
#   DEPTHS   needle depths, e.g. 0,0.5,1 (default: eval.py's 5 depths)
#   MODEL    checkpoint (default: the embedded SmolLM2-135M-Instruct)
#   DTYPE    float32 | bfloat16 | float16 (default: eval.py's: bfloat16 on cuda, float32 on cpu)
#   OUT      output dir (default bench/results/accuracy/apb_ablation_<device>_h<HOSTS>)
#   EXTRA    further eval.py flags for every run (e.g. "--format completion --max-new-tokens 32")
#
# One run directory per configuration under OUT (dense, star, apb, apb_no_anchor, apb_no_passing,
# apb_random, apb_no_embed), skipped when its summary.json already exists (rerun to resume). Then
# `launch/eval.py --compare` writes OUT/compare.md: accuracy per task and length, and the ratio of each
# configuration to dense.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

PY="${PYTHON:-python}"
DEVICE="${DEVICE:-$($PY -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')}"
LENGTHS="${LENGTHS:-2048,4096,8192}"
HOSTS="${HOSTS:-4}"
SAMPLES="${SAMPLES:-2}"
OUT="${OUT:-bench/results/accuracy/apb_ablation_${DEVICE}_h${HOSTS}}"
mkdir -p "$OUT"

common=(--lengths "$LENGTHS" --samples-per-cell "$SAMPLES" --device "$DEVICE" --no-progress)
[[ -n "${TASKS:-}" ]] && common+=(--tasks "$TASKS")
[[ -n "${DEPTHS:-}" ]] && common+=(--depths "$DEPTHS")
[[ -n "${MODEL:-}" ]] && common+=(--model "$MODEL")
[[ -n "${DTYPE:-}" ]] && common+=(--dtype "$DTYPE")
# shellcheck disable=SC2206  # EXTRA is word-split on purpose
[[ -n "${EXTRA:-}" ]] && common+=($EXTRA)

run() {  # run NAME [eval.py flags...]
  local name="$1"; shift
  if [[ -f "$OUT/$name/summary.json" ]]; then
    echo "== $name: done already ($OUT/$name)"; return
  fi
  echo "== $name: launch/eval.py $*"
  local t0=$SECONDS
  "$PY" launch/eval.py "${common[@]}" --strategy-name "$name" --out "$OUT/$name" "$@" | tee "$OUT/$name.log"
  echo "== $name: $((SECONDS - t0)) s"
}

apb=(--cp-strategy apb --apb-hosts "$HOSTS")
run dense
run star --cp-strategy star --num-blocks "$HOSTS"
run apb "${apb[@]}"
run apb_no_anchor "${apb[@]}" --anchor-size 0
run apb_no_passing "${apb[@]}" --passing-size 0
run apb_random "${apb[@]}" --compressor random
run apb_no_embed "${apb[@]}" --no-embed-query

"$PY" launch/eval.py --compare "$OUT/dense" "$OUT/star" "$OUT/apb" "$OUT/apb_no_anchor" "$OUT/apb_no_passing" \
  "$OUT/apb_random" "$OUT/apb_no_embed" --out "$OUT"
echo "== table: $OUT/compare.md"
