# cuDNN plans per padded length (kernels/attention.py plan_padded), one device call carrying .whl:
# `bench prefill --fresh 6` (after each length, 6 lengths from the 1/16 below it, none run before, each timed cold
# then warm) with the padding (this tree) and without it (the same tree, PLAN_PAD_MAX = 0: nopad.py), side by side:
# the Llama-3.1-8B shape, random bf16 weights, dense at 8K / 16K / 32K; APB over 4 hosts and Star over 4 blocks on
# one GPU (study mode, as the accuracy runs use them) at 16K. Targets: fresh_first_over_second ~1.0 with the padding
# (a new length costs its kernels only), the warm prefill_seconds as without it (padded rows: <= 1.6 % of a 16K
# call's attention).   bash bench/results/2026-12-07-plans/run.sh
# Ran 2026-12-07 on one H100 (summary.json; docs/results.md, "A prompt of a new length"): a length in a multiple seen
# before costs its kernels only, but a non-multiple length pays 2.6-3.8 % on every call (the padded copies).
LOG=log.txt; . bench/gpu_env.sh
P="prefill $L8B --dtype bfloat16 --decode-steps 0 --warmup 1 --repeats 3 --fresh 6 --fresh-seed 7"
for s in dense "apb --apb-hosts 4" "star --num-blocks 4"; do
  n=${s%% *}; lens=16384; [ $n = dense ] && lens=8192,16384,32768
  T=200 step python3 launch/bench.py $P --cp-strategy $s --lengths $lens --out $OUT/pad_$n.json
  T=200 step python3 bench/results/2026-12-07-plans/nopad.py launch/bench.py $P --cp-strategy $s --lengths $lens \
    --out $OUT/nopad_$n.json
done
python3 - $OUT <<'PY'
import json, pathlib, statistics, sys
out = pathlib.Path(sys.argv[1])
runs = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*pad_*.json"))}
(out / "summary.json").write_text(json.dumps({k: [{f: r.get(f) for f in ("length", "prefill_seconds", "fresh",
    "fresh_first_over_second")} for r in v["results"]] for k, v in runs.items()}, indent=1))
for k, v in runs.items():
    for r in v["results"]:
        f = r.get("fresh") or []
        print(k, r["length"], f"warm {r.get('prefill_seconds', 0):.4f} s", f"fresh first/second {r.get('fresh_first_over_second')}",
              f"extra on a new length {statistics.median(x['first_seconds'] - x['second_seconds'] for x in f) * 1e3:.1f} ms" if f else "")
PY
rm -f $OUT/*pad_*.json
