# Issue 48's paired accuracy on Qwen2.5-Coder-1.5B-Instruct (after stage.sh: the model converted in /tmp/sscache),
# one GPU, bf16, completion form: a single needle (niah_essay), 3 distractor needles (multikey) and a 4-step
# variable chain (variable_tracking) at 16,384 and 30,720 tokens, 5 depths x SEEDS seeds (default 30: 150 per
# task and length), seed 0, so that runs of later sessions pair with these sample for sample.
#   RUNS: which runs, in order (default "dense star4 apb4"; then "minference anchor fp8_lkv fp8_attn star4_a"
#   and the sparse defaults "minference_d anchor_d" (anchor_d on this model: its shipped calibration, since 2026-12-07; "anchor_f": that calibration
#   forced sparse, what `--sparse anchor --sparse-min-length 0` runs on it), the searched configs "minference_s anchor_s", Star over 2 blocks
#   "star2" (is the 4-hop loss one of blocks?)); each stops starting samples at its share of BUDGET;
#   PARALLEL=N runs N at once on the card (accuracy only).
# Keeps each run's per-sample results (compressed) and summaries.json (every run's summary) under $OUT: a call
# brings back at most 8 files, so at most 5 runs a call. Then compares what is there with dense (`launch/eval.py
# --compare`): paired share of dense's right answers, McNemar p, the losses classified.
# Across sessions: each run resumes (`--resume`) from a committed summaries.json (its entry holds every sample's
# outcome, enough to pair and resume; commit the call's summaries.json under bench/results/<date>-qwen/<call>/):
# PRIOR names one, else the last in path order of bench/results/*-qwen/*/summaries.json holding the run, or from
# .qwen/ev/<TAG><run>/{samples.jsonl,summary.json} here (not tracked; gone with a fresh checkout) when carried,
# so the samples add up to SEEDS per cell. fp8_lkv before the keys' offset (engine/model.py key_offset, 48 % kept)
# is kept apart as .qwen/ev/fp8_lkv_keys_whole: a run of this code must not resume it.
. bench/results/2026-12-06-step-loop/prelude.sh
export STARSHARD_CACHE=/tmp/sscache PYTHONPATH=/tmp/site:/tmp/qsite:$PWD
SEEDS=${SEEDS:-30}; BUDGET=${BUDGET:-540}; RUNS=${RUNS:-"dense star4 apb4"}; LENGTHS=${LENGTHS:-16384,30720}
# YaRN: LENGTHS=65536,131072 EXTRA="--rope-scaling yarn:4" TAG=yarn_ (run directories /tmp/ev/<TAG><run>)
TAG=${TAG:-}; EXTRA=${EXTRA:-}; PRIOR=${PRIOR:-$(ls bench/results/*-qwen/*/summaries.json | sort)}
E="--model qwen2.5-coder-1.5b-instruct --tasks niah_essay,multikey,variable_tracking --lengths $LENGTHS $EXTRA \
 --num-depths 5 --samples-per-cell $SEEDS --format completion --max-new-tokens 24 --no-progress --sample-workers 8"
SP="--sparse-min-length 0 --sparse-no-fallback"
C=${QCFG:-bench/results/2026-12-06-qwen/h100-b}  # the configs sparse_speed.sh searched (seed 1) on e4a235b
declare -A FLAGS=(
  [dense]="" [star4]="--cp-strategy star --num-blocks 4" [apb4]="--cp-strategy apb --apb-hosts 4"
  [minference]="--sparse minference $SP" [anchor]="--sparse anchor --anchor-theta 12 $SP" [minference_d]="--sparse minference"
  [anchor_d]="--sparse anchor" [anchor_f]="--sparse anchor $SP" [fp8_lkv]="--fp8 linear,kv" [fp8_kv]="--fp8 kv" [fp8_attn]="--fp8 attention"
  [star4_a]="--cp-strategy star --num-blocks 4 --anchor-size ${ANCHOR:-4096}" [star2]="--cp-strategy star --num-blocks 2"
  [minference_s]="--sparse minference --sparse-config $C/minference.json $SP"
  [anchor_s]="--sparse anchor --sparse-config $C/anchor.json $SP")
# minference_<x> / anchor_<x> not named above: the config $C/<run>.json (e.g. floors.sh's minference_r0.97); a run
# of no known name is refused (it would run dense under that name)
for r in $RUNS; do
  [ -n "${FLAGS[$r]+set}" ] && continue
  case $r in
    minference_*) FLAGS[$r]="--sparse minference --sparse-config $C/$r.json $SP";;
    anchor_*) FLAGS[$r]="--sparse anchor --sparse-config $C/$r.json $SP";;
    *) echo "paired.sh: no run named $r (RUNS); the runs: ${!FLAGS[*]}" >&2; exit 2;;
  esac
  [ -f $C/$r.json ] || { echo "paired.sh: $r needs $C/$r.json (QCFG)" >&2; exit 2; }
done
# PARALLEL runs share the card at once (each a 1.5B model, ~5 GB): the accuracy is the same, their prefill seconds
# are not a speed measurement then (sparse speed is measured apart); each run stops at the budget's end.
PARALLEL=${PARALLEL:-1}; [ $PARALLEL -gt 1 ] && E="${E/--sample-workers 8/--sample-workers 4}"
n=$(echo $RUNS | wc -w); waves=$(( (n + PARALLEL - 1) / PARALLEL )); share=$(( (BUDGET - $(( $(date +%s) - S ))) / waves ))
one() {  # resumes what an earlier session ran (carried .qwen/ev/<TAG><run>, else PRIOR's entry): only the rest runs
  lim=$(( share < 60 ? 60 : share )); mkdir -p /tmp/ev/$TAG$1
  [ -f .qwen/ev/$TAG$1/samples.jsonl ] && [ ! -f /tmp/ev/$TAG$1/samples.jsonl ] && cp .qwen/ev/$TAG$1/* /tmp/ev/$TAG$1/
  [ ! -f /tmp/ev/$TAG$1/summary.json ] && python3 -c "
import json, sys  # the last of the files that holds the run with its outcomes
*files, run, out = sys.argv[1:]
for f in reversed(files):
    e = json.load(open(f)).get(run) or {}
    if 'outcomes' in e:
        print(run, 'resumes', f, sum(len(c['codes']) for c in e['outcomes'].values()), 'samples')
        open(out, 'w').write(json.dumps(e)); break" $PRIOR $TAG$1 /tmp/ev/$TAG$1/summary.json
  timeout -k 10 $lim python3 launch/eval.py $E --resume --time-limit $((lim - 30)) --strategy-name $1 \
    --out /tmp/ev/$TAG$1 ${FLAGS[$1]} > $OUT/log_$1.txt 2>&1; t $1
  [ -f /tmp/ev/$TAG$1/samples.jsonl ] && gzip -c /tmp/ev/$TAG$1/samples.jsonl > $OUT/samples_$TAG$1.jsonl.gz
}
for r in $RUNS; do
  [ $(jobs -rp | wc -l) -ge $PARALLEL ] && wait -n
  one $r &
done
wait
R=""; for r in $RUNS; do [ -f /tmp/ev/$TAG$r/summary.json ] && R="$R /tmp/ev/$TAG$r"; done
python3 launch/eval.py --compare $R --out $OUT > /dev/null 2> $OUT/log_compare.txt; t compare
# A call brings back at most 8 files: the runs' summaries go in one (summaries.json: {<TAG><run>: summary}).
python3 -c "import json, pathlib, sys; print(json.dumps({p.parent.name: json.loads(p.read_text()) for p in map(pathlib.Path, sys.argv[1:])}))" \
  $(for r in $RUNS; do ls /tmp/ev/$TAG$r/summary.json 2>/dev/null; done) > $OUT/summaries.json; rm -f $OUT/compare.json
cat $OUT/log_*.txt > $OUT/all.log; rm -f $OUT/log_*.txt
cat $OUT/compare.md 2>/dev/null; grep -h "Traceback\|Error" $OUT/all.log | head -10
