#!/usr/bin/env python
"""Summarise a CP benchmark run (its tables: docs/results.md, Context parallel strategies):
measured prefill per strategy and length next to its FLOP model, read at the rate dense reaches on one
GPU, and the model's prediction where a run was not made (longer lengths, the other cp). Writes summary.json,
summary.md and prefill_cp.png into the run's directory.

    python bench/cp_summary.py bench/results/<run>      # the folder the run's logs and JSON went to

The model's time at the matmul peak is flops.predicted_seconds; "at dense's rate" multiplies it by
dense's own measured / model ratio (the 1-GPU run), so 1.00 means the strategy wastes no more than
dense does. Rows come from the run logs (a step stopped before writing its JSON still printed its rows);
each step's first row is its process's cold start and is dropped.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from starshard.strategies.apb import apb_flops  # noqa: E402
from starshard.strategies.dense import dense_flops  # noqa: E402
from starshard.strategies.flops import predicted_seconds  # noqa: E402
from starshard.strategies.ring import ring_flops  # noqa: E402
from starshard.strategies.star import star_flops  # noqa: E402
from starshard.presets import preset_config  # noqa: E402

CFG = preset_config("llama-3.1-8b")
Q = 64  # bench.py prefill --query-tokens default: the query of Star / APB
STRATS = {"dense": {}, "ring": {}, "ulysses": {}, "star": {"block": 32768, "anchor": 32768},
          "apb": {"anchor": 4096, "passing": 2048}}


def model_seconds(name: str, L: int, cp: int, peak: float) -> float:
    kw = STRATS[name]
    if name == "dense":
        ranks = dense_flops(CFG, L)
    elif name in ("ring", "ulysses"):
        ranks = ring_flops(CFG, L, cp)
    elif name == "star":
        ranks = star_flops(CFG, L - Q, cp, kw["block"], kw["anchor"], query_len=Q)
    else:
        ranks = apb_flops(CFG, L - Q, cp, kw["anchor"], kw["passing"], query_len=Q)
    return predicted_seconds(ranks, peak)


def measured(run: Path) -> dict[tuple[str, int], dict[int, float]]:
    """(strategy, cp) -> {length: warm prefill seconds} from the run logs (every row rank 0 printed). The
    first row of each step is the process's warm-up prefill (cold start) and is dropped."""
    out: dict[tuple[str, int], dict[int, float]] = {}
    for log in sorted(run.glob("run*.log")):
        key, first = None, False
        for line in log.read_text().splitlines():
            if line.startswith("=== ") and "bench.py prefill" in line:
                m = re.search(r"--cp-strategy (\w+)", line)
                cp = re.search(r"--cp (\d+)", line)
                key = (m.group(1) + ("_nopass" if "--passing-size 0" in line else ""), int(cp.group(1)) if cp else 1)
                first = True
            elif line.startswith("=== "):
                key = None
            elif line.startswith('{"length"') and key:
                row = json.loads(line)
                if not first and "prefill_seconds" in row:
                    out.setdefault(key, {})[row["length"]] = row["prefill_seconds"]
                first = False
    return out


def main(run: Path) -> None:
    dense = json.loads((run / "dense_1gpu.json").read_text())
    peak = dense["matmul_peak_tflops"] * 1e12
    got = measured(run)
    gpus = max(cp for _, cp in got)
    device = f"{gpus} x {dense['device']}"
    dense_rate = got[("dense", 1)][131072] / model_seconds("dense", 131072, 1, peak)
    lengths = [131072, 262144, 524288, 1048576]
    names = ("dense", "ring", "ulysses", "star", "apb")
    cps = {name: (1,) if name == "dense" else (2, 4) for name in names}
    rows = []
    for name in names:
        for cp in cps[name]:
            for L in lengths:
                m = model_seconds(name, L, cp, peak) * dense_rate
                t = got.get((name, cp), {}).get(L)
                rows.append({"strategy": name, "cp": cp, "length": L, "measured_seconds": t,
                             "model_seconds_at_dense_rate": m, "measured_over_model": t / m if t else None})
    usp = {L: t for L, t in got.get(("usp", gpus), {}).items()}
    nopass = got.get(("apb_nopass", gpus), {}).get(131072)
    summary = {"device": device, "shape": "llama-3.1-8b, random bf16 weights",
               "matmul_peak_tflops": peak / 1e12, "dense_measured_over_peak_model": dense_rate,
               "apb_exposed_gather_and_compressor_seconds_128k":
                   (got[("apb", gpus)][131072] - nopass) if nopass else None,
               "usp_measured_seconds": usp or None, "rows": rows}
    (run / "summary.json").write_text(json.dumps(summary, indent=1))

    def cell(name, cp, L, key):
        r = next(r for r in rows if (r["strategy"], r["cp"], r["length"]) == (name, cp, L))
        return r[key]

    md = ["Prefill seconds, Llama-3.1-8B shape, random bf16 weights, 64-token query. Measured (bold) on "
          f"{device}; model = FLOP model x dense's measured/peak ratio ({dense_rate:.2f}), in parentheses.",
          "",
          "| strategy | cp | " + " | ".join(f"{L // 1024}K" for L in lengths) + " |",
          "|---|---:|" + "---:|" * len(lengths)]
    for name in names:
        for cp in cps[name]:
            cells = []
            for L in lengths:
                t, m = cell(name, cp, L, "measured_seconds"), cell(name, cp, L, "model_seconds_at_dense_rate")
                cells.append(f"**{t:.2f}** ({m:.2f})" if t else f"({m:.2f})")
            md.append(f"| {name} | {cp} | " + " | ".join(cells) + " |")
    if usp:
        md.append(f"| usp (ulysses 2) | {gpus} | " + " | ".join(f"**{usp[L]:.2f}**" if L in usp else "" for L in lengths) + " |")
    (run / "summary.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for i, name in enumerate(names):
        cp = 1 if name == "dense" else gpus
        pts = sorted(got.get((name, cp), {}).items())
        color = f"C{i}"
        if pts:
            ax.plot(*zip(*pts), marker="o", color=color, label=f"{name}, {cp} GPU measured")
        ax.plot(lengths, [cell(name, cp, L, "model_seconds_at_dense_rate") for L in lengths], ls="--",
                color=color, alpha=0.6, label=f"{name}, {cp} GPU model")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("prefill seconds")
    ax.set_title(f"Prefill, Llama-3.1-8B shape, {device} (model: FLOPs at dense's rate)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(run / "prefill_cp.png", dpi=120)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
