# Issue 49's cases not measured at bef1329 (one call, one GPU): a cold disk hit in one process served as a split
# beside the same hit reloaded whole, then restarts on that directory: the split with reads throttled to 0.25x the
# measured rate (the tail paced since 06ed5c7), and a warm page cache's pure reload beside its split.
. bench/results/2026-12-06-step-loop/prelude.sh
go() { [ $(( $(date +%s) - S )) -lt $1 ]; }
D=/var/tmp/kv; rm -rf $D; mkdir -p $D
L=$(python3 -c "import random; print(random.randrange(126000, 136000))"); echo "length $L"
C="bench serve $L8B --scenario document --lengths $L --concurrency 1 --decode-tokens 4 --cache-gib 24 --disk-cache-dir $D --disk-cache-gib 20 --seed 13"
timeout 150 $NEW -m starshard $C --host-cache-gib 20 --tiers host,disk --out $OUT/tiers.json > $OUT/log_t.txt 2>&1; t tiers
go 250 && { timeout 130 $NEW -m starshard $C --tiers disk --disk-reload-policy split --out $OUT/tiers_split.json > $OUT/log_ts.txt 2>&1; t tiers_split; }
R="$C --reuse-only"
go 390 && { timeout 70 $NEW -m starshard $R --disk-reload-policy split --disk-read-throttle 0.25 --out $OUT/split_q.json > $OUT/log_sq.txt 2>&1; t split_quarter; }
go 470 && { timeout 45 $NEW -m starshard $R --disk-reload-policy always --page-cache warm --out $OUT/reload_warm.json > $OUT/log_rw.txt 2>&1; t reload_warm; }
go 525 && { timeout 45 $NEW -m starshard $R --disk-reload-policy split --page-cache warm --out $OUT/split_warm.json > $OUT/log_sw.txt 2>&1; t split_warm; }
rm -rf $D
cat $OUT/log_*.txt > $OUT/all.log; rm -f $OUT/log_*.txt
grep -h "Traceback\|Error" $OUT/all.log | head -12
python3 - $OUT <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for n in ("tiers", "tiers_split"):
    p = out / f"{n}.json"
    if p.exists():
        d = json.loads(p.read_text()); r = d["results"][0]
        print(n, "uncached", r["ttft_uncached_s"], "host", r.get("ttft_host_s"), "disk cold", r.get("ttft_disk_cold_s"),
              "bound", r.get("disk_bound_s"), {k: v for k, v in d.get("engine_stats", {}).items() if "split" in k})
for n in ("split_q", "reload_warm", "split_warm"):
    p = out / f"{n}.json"
    if p.exists():
        d = json.loads(p.read_text()); r = d["results"][0]
        print(n, "ttft", r["ttft_reuse_s"], "cached", r["cached_tokens"], "split", r.get("split"),
              "throttled bound", r.get("disk_bound_throttled_s"), "warm read GB/s", r.get("page_cache_read_gbps"))
PY
