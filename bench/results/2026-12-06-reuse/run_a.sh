# Issue 49's targets in one call (one GPU; run 2026-12-06 at 9c2e9e3: h100-a): a 128K document prefilled, pushed to the host and disk
# tiers (--disk-reload-policy always: host follow-up, cold disk reload, the disk's read bound), then new
# processes on the same directory (restarts) asking about it: split with and without a host tier, throttled to
# 0.25x and 1x the measured read rate, from a warm page cache, and a pure reload; bench prefill's whole prefill
# beside them. Each restart starts from the rates the runs before saved in the directory (reload-rates.json).
. bench/results/2026-12-06-step-loop/prelude.sh
go() { [ $(( $(date +%s) - S )) -lt $1 ]; }
D=/var/tmp/kv; rm -rf $D; mkdir -p $D; df -h $D | tail -1
L=$(python3 -c "import random; print(random.randrange(126000, 136000))"); echo "length $L"
C="bench serve $L8B --scenario document --lengths $L --concurrency 1 --decode-tokens 4 --cache-gib 24 --disk-cache-dir $D --disk-cache-gib 20 --seed 7"
timeout 60 $NEW -m starshard bench prefill $L8B --lengths $L --repeats 1 --out $OUT/prefill.json > $OUT/log_p.txt 2>&1; t prefill
timeout 200 $NEW -m starshard $C --host-cache-gib 20 --tiers host,disk --out $OUT/tiers.json > $OUT/log_t.txt 2>&1; t tiers
R="$C --reuse-only"
go 300 && { timeout 70 $NEW -m starshard $R --disk-reload-policy split --out $OUT/split.json > $OUT/log_s.txt 2>&1; t split; }
go 370 && { timeout 70 $NEW -m starshard $R --disk-reload-policy split --host-cache-gib 20 --out $OUT/split_host.json > $OUT/log_sh.txt 2>&1; t split_host; }
go 440 && { timeout 80 $NEW -m starshard $R --disk-reload-policy split --disk-read-throttle 0.25 --out $OUT/split_q.json > $OUT/log_sq.txt 2>&1; t split_quarter; }
go 500 && { timeout 60 $NEW -m starshard $R --disk-reload-policy split --page-cache warm --out $OUT/split_warm.json > $OUT/log_sw.txt 2>&1; t split_warm; }
go 540 && { timeout 55 $NEW -m starshard $R --disk-reload-policy always --out $OUT/reload.json > $OUT/log_r.txt 2>&1; t reload; }
cp $D/reload-rates.json $OUT/ 2>/dev/null
cat $OUT/log_*.txt > $OUT/all.log; rm -f $OUT/log_*.txt
grep -h "Traceback\|Error\|warning" $OUT/all.log | head -20
python3 - $OUT <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def load(n):
    p = out / f"{n}.json"
    return json.loads(p.read_text()) if p.exists() else None
pre = load("prefill"); whole = pre["results"][0]["prefill_seconds"] if pre else None
print("whole prefill (bench prefill)", whole)
t = load("tiers")
if t:
    r = t["results"][0]
    print("uncached", r["ttft_uncached_s"], "host", r.get("ttft_host_s"), "disk cold", r.get("ttft_disk_cold_s"),
          "bound", r.get("disk_bound_s"), "read GB/s", (r.get("disk") or {}).get("disk_read_gbps"))
for n in ("split", "split_host", "split_q", "split_warm", "reload"):
    d = load(n)
    if d:
        r = d["results"][0]
        print(n, "ttft", r["ttft_reuse_s"], "over whole", r["ttft_reuse_s"] / whole if whole else None, "cached",
              r["cached_tokens"], "split", r.get("split"), "throttled bound", r.get("disk_bound_throttled_s"),
              "engine", {k: v for k, v in d.get("engine_stats", {}).items() if "split" in k or "tail" in k or "reload" in k})
PY
