"""Summaries of scored samples: per task x length, a length x depth heat map, strategy vs dense."""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path


def summarize(rows: list[dict]) -> dict:
    """rows: {task, length, depth, score} -> {"by_task": {task: {length: acc}}, "by_length_depth": ..., "overall"}."""
    by_task, grid = defaultdict(lambda: defaultdict(list)), defaultdict(lambda: defaultdict(list))
    for r in rows:
        by_task[r["task"]][r["length"]].append(r["score"])
        grid[r["length"]][r["depth"]].append(r["score"])
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {
        "by_task": {t: {str(L): mean(v) for L, v in sorted(d.items())} for t, d in sorted(by_task.items())},
        "by_length_depth": {str(L): {str(dp): mean(v) for dp, v in sorted(d.items())} for L, d in sorted(grid.items())},
        "overall": mean([r["score"] for r in rows]) if rows else 0.0,
        "samples": len(rows),
    }


def task_table(summary: dict, name: str) -> str:
    lengths = sorted({L for d in summary["by_task"].values() for L in d}, key=int)
    lines = [f"| task ({name}) | " + " | ".join(lengths) + " |", "|---|" + "---:|" * len(lengths)]
    for task, d in summary["by_task"].items():
        lines.append(f"| {task} | " + " | ".join(f"{100 * d[L]:.0f}" if L in d else "" for L in lengths) + " |")
    lines.append(f"| **overall** | {100 * summary['overall']:.1f} ({summary['samples']} samples) |" + " |" * (len(lengths) - 1))
    return "\n".join(lines)


def compare_table(run_dirs: list[Path]) -> str:
    """Strategy vs dense (the run named 'dense', else the first): accuracy and ratio per task."""
    runs = [(json.loads((d / "summary.json").read_text())) for d in run_dirs]
    base = next((r for r in runs if r["strategy"] == "dense"), runs[0])
    tasks = sorted(base["summary"]["by_task"])
    head = "| strategy | overall | ratio to " + base["strategy"] + " | " + " | ".join(tasks) + " |"
    lines = [head, "|---|---:|---:|" + "---:|" * len(tasks)]
    for r in runs:
        s = r["summary"]
        ratio = s["overall"] / base["summary"]["overall"] if base["summary"]["overall"] else float("nan")
        per = " | ".join(f"{100 * sum(s['by_task'].get(t, {}).values()) / max(1, len(s['by_task'].get(t, {}))):.0f}" for t in tasks)
        lines.append(f"| {r['strategy']} | {100 * s['overall']:.1f} | {ratio:.3f} | {per} |")
    return "\n".join(lines)


def heatmap(summary: dict, title: str, out: Path) -> bool:
    """Length x depth accuracy as a PNG; False (with no file) if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    grid = summary["by_length_depth"]
    lengths = sorted(grid, key=int)
    depths = sorted({dp for d in grid.values() for dp in d}, key=float)
    data = [[grid[L].get(dp, float("nan")) * 100 for L in lengths] for dp in depths]
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(lengths), 1.2 + 0.45 * len(depths)))
    im = ax.imshow(data, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)), lengths)
    ax.set_yticks(range(len(depths)), [f"{float(d):.2f}" for d in depths])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("needle depth")
    for i, row in enumerate(data):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=8)
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label="accuracy %")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True
