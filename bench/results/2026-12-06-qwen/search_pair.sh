# One call after stage.sh: the sparse configs searched at the length where the 16K ones fell short (30K: MInference
# 95.5 %, AnchorAttention 92.4 % of dense's right answers, h100-e/), on several samples of seed 1 (tuned there), then
# their speed at 128K (YaRN x4, essay text of seed 2: dense, MInference, AnchorAttention, dense again, side by side)
# and their accuracy paired on seed 0's samples (fresh) at 16K and 30K, run directories <TAG>minference_s and
# <TAG>anchor_s (default TAG s30_), resumed and kept as paired.sh does; they pair with a dense run of the same
# seeds (`launch/eval.py --compare <dense dir> <TAG><run> dir`, a directory holding its summary.json is enough).
#   SEARCH_LENGTH (30720), SEARCH_ARGS, given to both tools (flags both take: --samples, --tasks, --target-recall; default
#   three samples, one per task, the 4-hop chain among them, recall 0.99; "": each tool's defaults, minference-search one
#   multikey sample, anchor-calibrate three of multikey, niah_essay, multiquery, as h100-s/ ran it), MI_ARGS: to
#   minference-search alone (e.g. "--recall-by block", or "--kinds a_shape,vertical_slash"), SEARCH_TIMEOUT (300 s),
#   SPEED (1; 0: no 128K timing), BUDGET: seconds for the paired runs (the rest of the call), SEEDS as paired.sh; PAIR_RUNS: the paired runs
#   (default "minference_s anchor_s"; at a length with no dense run to pair with yet, "dense minference_s anchor_s").
# END (580): seconds from the call's start (CALL_START, prelude.sh) to stop the paired runs by; after stage.sh in the
#   same call: `export CALL_START=$(date +%s); C=17 bash .../stage.sh && END=540 bash .../search_pair.sh`.
# At 128K (YaRN x4, the configs searched there on one sample, pairing at 128K): SEARCH_LENGTH=131072 SEARCH_ARGS=""
#   SEARCH_TIMEOUT=240 LENGTHS=131072 EXTRA="--rope-scaling yarn:4" TAG=y128_ PAIR_RUNS="dense minference_s anchor_s".
. bench/results/2026-12-06-step-loop/prelude.sh
export STARSHARD_CACHE=/tmp/sscache PYTHONPATH=/tmp/site:/tmp/qsite:$PWD
M=qwen2.5-coder-1.5b-instruct; mkdir -p /tmp/qcfg; SL=${SEARCH_LENGTH:-30720}; TS=${SEARCH_TIMEOUT:-300}
RS=""; [ $SL -gt 32768 ] && RS="--rope-scaling yarn:4"
SA=${SEARCH_ARGS-"--samples 3 --tasks multikey,variable_tracking,niah_essay"}
# a search runs only where a later step reads its config (the 128K timing reads both; each paired run its own)
need() { [ "${SPEED:-1}" = 1 ] || case " ${PAIR_RUNS:-minference_s anchor_s} " in *" $1 "*) ;; *) false;; esac; }
# the two searches share the card at once (each a 1.5B model and its sample's activations): half the wait
{ [ -f /tmp/qcfg/minference.json ] || ! need minference_s || timeout $TS python3 -m starshard minference-search --model $M --device cuda \
  --dtype bfloat16 --seed 1 --length $SL $RS $SA ${MI_ARGS:-} --out /tmp/qcfg/minference.json > $OUT/log_search.txt 2>&1
  t search; } &
{ [ -f /tmp/qcfg/anchor.json ] || ! need anchor_s || timeout $TS python3 -m starshard anchor-calibrate --model $M --device cuda \
  --dtype bfloat16 --seed 1 --length $SL $RS $SA --out /tmp/qcfg/anchor.json > $OUT/log_calibrate.txt 2>&1
  t calibrate; } &
wait
cp /tmp/qcfg/*.json $OUT/ 2>/dev/null
# SPEED=0 leaves the 128K timing out (a short call: the searched configs come back for later sessions to pair)
if [ "${SPEED:-1}" = 1 ]; then
python3 bench/make_essay.py --out /tmp/essay.txt --seed 2 > /dev/null
B="python3 -m starshard bench prefill --model $M --prompt-file /tmp/essay.txt --dtype bfloat16 --decode-steps 0
   --cp-strategy dense --lengths 131072 --rope-scaling yarn:4 --warmup 1 --repeats 2"
for run in dense minference_s anchor_s dense_after; do
  case $run in
    minference_s) F="--sparse minference --sparse-config /tmp/qcfg/minference.json";;
    anchor_s) F="--sparse anchor --sparse-config /tmp/qcfg/anchor.json";; *) F="";;
  esac
  timeout 90 $B $F --out /tmp/prefill_$run.json > $OUT/log_$run.txt 2>&1; t $run
done
python3 - <<'PY' > $OUT/prefill.json
import json, pathlib
print(json.dumps({p.stem[8:]: json.loads(p.read_text()) for p in pathlib.Path("/tmp").glob("prefill_*.json")}))
PY
python3 - $OUT/prefill.json <<'PY'
import json, sys
runs = json.load(open(sys.argv[1]))
base = min(runs[k]["results"][0]["prefill_seconds"] for k in ("dense", "dense_after") if k in runs)
for name, d in runs.items():
    r = d["results"][0]
    print(name, r["length"], f"{r['prefill_seconds']:.3f} s", f"{base / r['prefill_seconds']:.2f}x")
PY
fi
# the paired runs: paired.sh with these configs (its all.log takes this call's logs too; at most 8 files come back)
left=$(( ${END:-580} - $(date +%s) + S ))  # what is left of the call; paired.sh counts it from its own start
CALL_START= QCFG=/tmp/qcfg TAG=${TAG:-s30_} RUNS=${PAIR_RUNS:-"minference_s anchor_s"} PARALLEL=3 BUDGET=${BUDGET:-$left} \
  bash bench/results/2026-12-06-qwen/paired.sh
# without dense the runs were compared with each other: they pair with dense apart, not in the call
case " ${PAIR_RUNS:-} " in *" dense "*) ;; *) rm -f $OUT/compare.md;; esac
