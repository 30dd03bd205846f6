# One call (one GPU, ~500 s): the table decode after 31a2681 (its device-read length as int32: 64-bit key masks
# made the 16-question table kernel 1.14x the general launch, h100-j/), and the warm-up against the parent, pair by
# pair. Trees: this one (new), .prev (`git archive a4703ea starshard launch`, before 31a2681), .base (the parent
# 2f17e11, `git archive`). Each phase starts only while the call's time (END seconds, default 540) allows:
# 0. the GPU tests of the kept graphs; 1. table_probe.py, new then .prev, same inputs; 2. 1 / 16 questions on one
# cached document of a length drawn now, new, .prev (16) and the parent; 3. warm-ups new, parent, new, parent,
# each on its own empty Triton cache, with the log's phases (cut model, graphs). SERVES="" WARMUPS="new base new base
# new base": no serve runs, three warm-up pairs instead (the warm-up's 1.1x target is a ratio of noisy runs).
. bench/results/2026-12-06-step-loop/prelude.sh
END=${END:-540}; . bench/results/2026-12-06-step-loop/phases.sh
for tree in ${PROBES-new prev}; do  # PROBES="" skips the table probes
  P=$PWD; [ $tree != new ] && P=$PWD/.$tree
  go 60 && timeout 60 env PYTHONPATH=/tmp/site:$P python3 -P bench/results/2026-12-06-step-loop/table_probe.py \
    $OUT/table_$tree.json "$LEN,131072" > $OUT/log_t$tree.txt 2>&1; t table_$tree
  grep -h "'questions': 16" $OUT/log_t$tree.txt | cut -c1-200
done
# SERVES: which trees serve, and at which concurrencies ("" skips the phase)
for sv in ${SERVES-new:1,16 prev:16 base:1,16}; do serve ${sv%%:*} ${sv#*:}; done
A="serve $L8B --scenario document --lengths 100003 --cache-gib 30 --decode-tokens 2 --concurrency 1,16"
i=0
for tree in ${WARMUPS:-new base new base}; do  # in turn, each pair side by side
  i=$((i + 1)); P=$PWD; [ $tree != new ] && P=$PWD/.$tree
  TC=/tmp/triton_w$i; rm -rf $TC; mkdir -p $TC
  go 80 && TRITON_CACHE_DIR=$TC timeout 80 env PYTHONPATH=/tmp/site:$P python3 -P -c "$W" $A \
    --out $OUT/warmup_${tree}$i.json > $OUT/log_w$i.txt 2>&1; t warmup_${tree}$i
  grep -h "warm-up:" $OUT/log_w$i.txt 2>/dev/null | cut -c1-220
done
cat $OUT/log_*.txt > $OUT/all.log 2>/dev/null; rm -f $OUT/log_*.txt
# at most 8 files come back: the warm-ups' JSONs go in one ({run: bench serve's JSON})
python3 -c "import json, pathlib, sys; print(json.dumps({p.stem: json.loads(p.read_text()) for p in map(pathlib.Path, sys.argv[1:])}))" \
  $OUT/warmup_*.json > /tmp/warmups.json 2>/dev/null && rm -f $OUT/warmup_*.json && mv /tmp/warmups.json $OUT/warmups.json
grep -h "Traceback\|Error" $OUT/all.log | head -5
python3 bench/results/2026-12-06-step-loop/summary.py $OUT 2>&1 | grep -v "^ *prefill" | head -40
python3 -c "
import json; w = json.load(open('$OUT/warmups.json'))
for k, v in w.items(): print(k, 'warmup_s', v.get('warmup_s'), v.get('warmup_phases_s'))" 2>&1 | head -6
