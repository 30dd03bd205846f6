# One call (one GPU): where the start-up warm-up's time goes since the kept decode graphs (run_n.sh: 33.86 s
# against the parent's 29.03 s with an empty Triton cache, 1.17x). This tree twice on one Triton cache (empty,
# then filled: compilation apart from capture), its log's phases (the cut model's steps; the kept graphs'
# capture and check), and the parent's with an empty cache. Then a document pushed to disk without a host tier:
# the step that copies its shard to pageable memory (issue 49).
. bench/results/2026-12-06-step-loop/prelude.sh
go() { [ $(( $(date +%s) - S )) -lt $1 ]; }
W="import logging, sys; logging.basicConfig(level=logging.INFO, format='%(relativeCreated)d %(message)s')
from starshard.commands.bench import main; main(sys.argv[1:])"
A="serve $L8B --scenario document --lengths 100003 --cache-gib 30 --decode-tokens 2 --concurrency 1,16"
TC=$(mktemp -d)
for run in empty filled; do
  TRITON_CACHE_DIR=$TC timeout 75 $NEW -c "$W" $A --out $OUT/warmup_$run.json > $OUT/log_w$run.txt 2>&1; t warmup_$run
  grep -h "warm-up:" $OUT/log_w$run.txt
done
echo "triton kernels cached: $(ls $TC | wc -l)"
TRITON_CACHE_DIR=$(mktemp -d) timeout 75 $BASE -m starshard bench $A --out $OUT/warmup_base.json > $OUT/log_wbase.txt 2>&1
t warmup_base
D=/var/tmp/kv; rm -rf $D; mkdir -p $D
go 150 && { timeout 60 $NEW -m starshard bench serve $L8B --scenario document --lengths 117001 --concurrency 1 \
  --decode-tokens 2 --cache-gib 24 --disk-cache-dir $D --disk-cache-gib 20 --tiers disk --disk-reload-policy split \
  --out $OUT/tiers_disk.json > $OUT/log_td.txt 2>&1; t tiers_disk; }
rm -rf $D
cat $OUT/log_*.txt > $OUT/all.log; rm -f $OUT/log_*.txt
grep -h "Traceback\|Error" $OUT/all.log | head -8
python3 - $OUT <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for n in ("warmup_empty", "warmup_filled", "warmup_base", "tiers_disk"):
    try:
        d = json.loads((out / f"{n}.json").read_text())
    except OSError:
        continue
    r = d["results"][0]
    print(n, "warmup_s", round(d["warmup_s"], 2), "kept", d.get("engine_stats", {}).get("decode_graphs_kept"),
          {k: r.get(k) for k in ("ttft_uncached_s", "demote_disk_s", "demote_disk_longest_step_s", "ttft_disk_cold_s",
                                  "disk_cold_cached_tokens") if k in r})
PY
