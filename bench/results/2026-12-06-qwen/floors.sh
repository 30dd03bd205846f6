# Issue 48, MInference at 128K with YaRN x4, one call after stage.sh: configs searched on one 128K multikey sample of
# seed 1 at several recall floors (FLOORS, default "0.95 0.96"; the 0.99 floor ran 1.30x dense and kept 17 of 17
# of dense's right answers, the 16K search 2.78x and 87 %: 2026-12-07-qwen/h100-k, h100-l), one search after another
# (three at once ran out of an 80 GB card's memory: 24-30 GB each at 128K; 70-105 s each alone); then each timed
# at 128K on the essay of seed 2 beside dense (before and after); then each paired with dense at 128K on seed 0's
# samples (paired.sh, TAG y128_: dense resumes the last committed y128_dense, each config run minference_r<floor>
# its own; 0.98 and 0.97: 2026-12-07-qwen/h100-m, h100-n). A later call pairs more: QCFG=<the committed dir>
# LENGTHS=131072 EXTRA="--rope-scaling yarn:4" TAG=y128_ RUNS="dense minference_r0.97 ..." bash paired.sh.
#   FLOORS, SEARCH_TIMEOUT (300 s), END: when the call's pairing stops (580 s after the start).
. bench/results/2026-12-06-step-loop/prelude.sh
export STARSHARD_CACHE=/tmp/sscache PYTHONPATH=/tmp/site:/tmp/qsite:$PWD
M=qwen2.5-coder-1.5b-instruct; FLOORS=${FLOORS:-"0.95 0.96"}; mkdir -p /tmp/qcfg
for f in $FLOORS; do
  { [ -f /tmp/qcfg/minference_r$f.json ] || timeout ${SEARCH_TIMEOUT:-300} python3 -m starshard minference-search \
      --model $M --device cuda --dtype bfloat16 --seed 1 --length 131072 --rope-scaling yarn:4 --target-recall $f \
      --quiet --out /tmp/qcfg/minference_r$f.json > $OUT/log_search_$f.txt 2>&1; t search_$f; }
done
# a call brings back at most 8 files: the configs go in one (configs.json: {run: config}); unpack each to
# <dir>/minference_r<floor>.json when committing, for paired.sh's QCFG
python3 -c "import json, pathlib, sys; print(json.dumps({p.stem: json.loads(p.read_text()) for p in map(pathlib.Path, sys.argv[1:])}))" \
  /tmp/qcfg/minference_r*.json > $OUT/configs.json
python3 bench/make_essay.py --out /tmp/essay.txt --seed 2 > /dev/null
# --idle: the GPU's idle time within a prefill; --fresh 1: a length unequal to the search's and the warm-up's
B="python3 -m starshard bench prefill --model $M --prompt-file /tmp/essay.txt --dtype bfloat16 --decode-steps 0
   --cp-strategy dense --lengths 131072 --rope-scaling yarn:4 --warmup 1 --repeats 2 --idle --fresh 1 --fresh-seed 11"
runs="dense"; for f in $FLOORS; do [ -f /tmp/qcfg/minference_r$f.json ] && runs="$runs minference_r$f"; done
rm -f /tmp/floor_*.json
for run in $runs dense_after; do
  F=""; case $run in minference_*) F="--sparse minference --sparse-config /tmp/qcfg/$run.json";; esac
  timeout 90 $B $F --out /tmp/floor_$run.json > $OUT/log_$run.txt 2>&1; t $run
done
python3 - $OUT/prefill.json <<'PY'
import json, pathlib, sys
runs = {p.stem[6:]: json.loads(p.read_text()) for p in sorted(pathlib.Path("/tmp").glob("floor_*.json"))}
pathlib.Path(sys.argv[1]).write_text(json.dumps(runs))
base = min(runs[k]["results"][0]["prefill_seconds"] for k in ("dense", "dense_after") if k in runs)
for name, d in runs.items():
    r = d["results"][0]
    rep = r.get("sparse_report") or {}
    idle, fresh = r.get("device_idle") or {}, (r.get("fresh") or [{}])[0]
    print(name, r["length"], f"{r['prefill_seconds']:.3f} s", f"{base / r['prefill_seconds']:.2f}x",
          f"GPU idle {idle.get('idle_s', 0) * 1e3:.1f} ms in {idle.get('gaps')} gaps",
          f"fresh {fresh.get('length')}: {fresh.get('second_seconds', 0):.3f} s warm",
          f"heads dense {rep.get('heads_dense')} of {rep.get('heads_dense', 0) + rep.get('heads_sparse', 0)}" if rep else "")
PY
left=$(( ${END:-580} - $(date +%s) + S ))  # what is left of the call; paired.sh counts it from its own start
CALL_START= QCFG=/tmp/qcfg LENGTHS=131072 EXTRA="--rope-scaling yarn:4" TAG=y128_ RUNS="$runs" PARALLEL=4 BUDGET=$left \
  bash bench/results/2026-12-06-qwen/paired.sh
rm -f $OUT/samples_*.gz
