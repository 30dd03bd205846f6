"""Per calibration file: the density the chosen thetas keep (mean, median, heads under a few levels),
the time the sparse fallback's cost model gives against dense (a head runs sparse when density / rate < 1,
rate = kernels/anchor.py MEASURED_ANCHOR_RATES at head dim 64), and the mean finite theta."""
import json
import math
import statistics
import sys

from starshard.kernels.anchor import MEASURED_ANCHOR_RATES

RATE = MEASURED_ANCHOR_RATES[64].kernel

for path in sys.argv[1:]:
    d = json.load(open(path))
    heads = [h for layer in d["layers"] for h in layer.values()]
    dens = [h["density"] for h in heads]
    thetas = [float(h["theta"]) for h in heads if math.isfinite(float(h["theta"]))]
    under = {t: sum(x < t for x in dens) for t in (0.1, 0.2, 0.3, 0.4)}
    model = sum(min(1.0, x / RATE) for x in dens) / len(dens)
    print(json.dumps({"file": path.rsplit("/", 1)[-1], "tokens": d["meta"]["samples"]["tokens"], "heads": len(heads),
                      "mean_density": round(statistics.mean(dens), 3), "median_density": round(statistics.median(dens), 3),
                      "heads_under": under, "mean_theta": round(statistics.mean(thetas), 2),
                      "model_time_over_dense": round(model, 3)}))
