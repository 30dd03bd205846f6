# Star on one GPU without the anchor's recompute (c5a2d42: rank 0 reads the anchor's K/V from its cache), one device
# call carrying .whl: the Llama-3.1-8B shape, random bf16 weights, dense and Star over 4 blocks (study mode, as the
# accuracy runs use it) and APB over 4 hosts (study mode: the dearest run of the accuracy calls, 0.707 s at 16K,
# 1.42x dense, 2026-12-07-plans) at 16K and 32K, each with --idle (the GPU's idle time within a prefill: is APB's
# cost host-bound?), then the CUDA test of the stored anchor against the recomputed one, the test that a prefill makes no
# sync but its token's (dense, Star, APB; sparse, windowed, MoE, chunked and FP8 prefills) and that small host copies
# do not wait for the GPU. FRESH (default "--fresh 2 --fresh-seed 11"):
# lengths unequal to the warm-up's, timed cold and warm. Before (the same card kind,
# a099841 + padding, 2026-12-07-plans): Star over 4 blocks 0.827 s at 16K against dense 0.498 s (1.66x). Target: Star
# over 4 blocks at or under dense.
#   bash bench/results/2026-12-07-star/run.sh
LOG=log.txt; . bench/gpu_env.sh
P="prefill $L8B --dtype bfloat16 --decode-steps 0 --warmup 1 --repeats 3 --lengths 16384,32768 --idle ${FRESH---fresh 2 --fresh-seed 11}"
T=200 step python3 launch/bench.py $P --cp-strategy dense --out $OUT/dense.json
T=200 step python3 launch/bench.py $P --cp-strategy star --num-blocks 4 --out $OUT/star4.json
T=200 step python3 launch/bench.py $P --cp-strategy apb --apb-hosts 4 --out $OUT/apb4.json
T=200 step python3 -m pytest -q tests/parallel/test_star.py -k cuda
T=400 step python3 -m pytest -q tests/gpu/test_gpu.py -k "sync or host_copies"
python3 - $OUT <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
runs = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json")) if p.stem != "summary"}
rows = {k: {r["length"]: {"prefill_seconds": r["prefill_seconds"], "device_idle_s": (r.get("device_idle") or {}).get("idle_s"),
                          "model_seconds": r.get("model_seconds"),
                          "fresh": r.get("fresh"), "fresh_first_over_second": r.get("fresh_first_over_second")} for r in v["results"]} for k, v in runs.items()}
(out / "summary.json").write_text(json.dumps({"device": runs["dense"]["device"], "commit": runs["dense"]["commit"],
                                              "runs": rows}, indent=1))
for L, d in rows["dense"].items():
    for name in ("star4", "apb4"):
        s = rows[name][L]
        print(L, f"dense {d['prefill_seconds']:.4f} s, {name} {s['prefill_seconds']:.4f} s = "
              f"{s['prefill_seconds'] / d['prefill_seconds']:.3f}x, GPU idle {1e3 * (d['device_idle_s'] or 0):.1f} / "
              f"{1e3 * (s['device_idle_s'] or 0):.1f} ms")
        for a, b in zip(d["fresh"] or [], s["fresh"] or []):  # the same seed draws the same new lengths
            print(f"  new length {a['length']}: dense {a['first_seconds']:.4f} / {a['second_seconds']:.4f} s, {name} "
                  f"{b['first_seconds']:.4f} / {b['second_seconds']:.4f} s (first / second run) = "
                  f"{b['second_seconds'] / a['second_seconds']:.3f}x warm")
PY
rm -f $OUT/dense.json $OUT/star4.json $OUT/apb4.json
