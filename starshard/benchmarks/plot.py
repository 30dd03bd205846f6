"""Latency vs length (log-log) from result JSON files of `launch/bench.py prefill`, `hf` or `attention`.

    python launch/bench.py plot r1.json r2.json --out latency.png
"""
from __future__ import annotations

import json
from pathlib import Path

HELP = "latency vs length from result JSON files"


def add_arguments(p) -> None:
    p.add_argument("files", nargs="+")
    p.add_argument("--out", required=True, help="PNG path")
    p.add_argument("--title", default="prefill latency", help="plot title")


def run(args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for f in args.files:
        r = json.loads(Path(f).read_text())
        if r["kind"] == "attention":
            series = {}
            for row in r["results"]:
                if "seconds" in row:
                    series.setdefault(f"{row['strategy']} ({row['gpus']} GPU)", []).append((row["length"], row["seconds"]))
        else:
            label = f"{r.get('strategy', r['kind'])} ({r['gpus']} GPU)"
            series = {label: [(x["length"], x["prefill_seconds"]) for x in r["results"] if "prefill_seconds" in x]}
        for label, pts in series.items():
            xs, ys = zip(*sorted(pts))
            ax.plot(xs, ys, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens")
    ax.set_ylabel("seconds")
    ax.set_title(args.title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
