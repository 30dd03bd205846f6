"""Reports of scored samples: summaries per task and length, markdown tables, length x depth heat
maps, and the strategy-vs-dense table built from earlier run directories.

A run directory holds samples.jsonl (one scored row per sample), summary.json ({strategy, ...,
"summary": summarize(rows), "outcomes": outcomes(rows)}), table.md and heatmap*.png. The outcomes are each
sample's score and loss class in a few characters: a summary.json alone (kept in the repository, where the
per-sample rows are not) still pairs with later runs and resumes.
"""
from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from starshard.evaluation import tasks
from starshard.evaluation.scoring import found

PLOT_HINT = "matplotlib is not installed, so no heat map was drawn (pip install matplotlib)"


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def _by(rows: list[dict], *keys: str) -> dict:
    """Nested {k1: {k2: mean score}} over rows, keys stringified (JSON-friendly) and sorted numerically."""
    if not keys:
        return _mean([r["score"] for r in rows])
    groups: dict = defaultdict(list)
    for r in rows:
        groups[r[keys[0]]].append(r)
    order = sorted(groups, key=lambda k: (isinstance(k, str), k))
    return {str(k): _by(groups[k], *keys[1:]) for k in order}


def summarize(rows: list[dict]) -> dict:
    """rows: {task, length, depth (None for depth-less tasks), score} -> accuracies (0..1)."""
    placed = [r for r in rows if r.get("depth") is not None]
    return {
        "overall": _mean([r["score"] for r in rows]) if rows else 0.0,
        "samples": len(rows),
        "by_task": _by(rows, "task", "length"),
        "by_task_overall": _by(rows, "task"),
        "by_length": _by(rows, "length"),
        "by_length_depth": _by(placed, "length", "depth"),  # needle tasks only: depth means nothing elsewhere
        "by_task_length_depth": _by(placed, "task", "length", "depth"),
    }


def _pct(x: float) -> str:
    return "–" if x is None or math.isnan(x) else f"{100 * x:.0f}"


def task_table(summary: dict, name: str) -> str:
    """Markdown: accuracy % per task (rows) and length (columns), with per-task and per-length totals."""
    lengths = sorted({L for d in summary["by_task"].values() for L in d}, key=int)
    lines = [f"| task ({name}) | " + " | ".join(lengths) + " | all |", "|---|" + "---:|" * (len(lengths) + 1)]
    for task, d in summary["by_task"].items():
        total = summary.get("by_task_overall", {}).get(task, _mean(list(d.values())))
        lines.append(f"| {task} | " + " | ".join(_pct(d.get(L, float("nan"))) for L in lengths) + f" | {_pct(total)} |")
    per_len = summary.get("by_length", {})
    lines.append("| **all tasks** | " + " | ".join(_pct(per_len.get(L, float("nan"))) for L in lengths)
                 + f" | **{100 * summary['overall']:.1f}** |")
    lines.append(f"\n{summary['samples']} samples; accuracy in %.")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Strategy vs dense


# Run settings that change the prompts themselves: paired runs must agree on them.
PROMPT_FIELDS = ("tasks_version", "format", "reserve_tokens")


@dataclass
class Run:
    name: str
    rows: list[dict]
    path: Path
    meta: dict


def row_key(r: dict) -> tuple:
    """A sample's identity across runs: (task, length, depth, seed)."""
    return r["task"], int(r["length"]), r.get("depth"), int(r["seed"])


def is_run(path: Path) -> bool:
    """Whether `path` holds a run's samples: samples.jsonl, or a summary.json with its outcomes."""
    path = Path(path)
    if (path / "samples.jsonl").is_file():
        return True
    return (path / "summary.json").is_file() and "outcomes" in json.loads((path / "summary.json").read_text())


def load_run(path: Path) -> Run:
    """A run directory's rows: samples.jsonl's, else those its summary.json's outcomes keep (no outputs)."""
    path = Path(path)
    samples, summary = path / "samples.jsonl", path / "summary.json"
    meta = json.loads(summary.read_text()) if summary.is_file() else {}
    if samples.is_file():
        rows = [json.loads(line) for line in samples.read_text().splitlines() if line.strip()]
    elif "outcomes" in meta:
        rows = outcome_rows(meta["outcomes"])
    else:
        raise FileNotFoundError(f"{path} is not an eval run directory: it has no {samples.name}, and no "
                                f"{summary.name} with the samples' outcomes")
    meta.pop("summary", None)
    meta.pop("outcomes", None)
    return Run(meta.get("strategy", path.name), rows, path, meta)


@dataclass
class Paired:
    """Runs restricted to the samples every one of them has: `kept[name]` their rows, `ref` the base run."""

    runs: list[Run]
    ref: Run
    common: set
    kept: dict[str, list[dict]]

    @property
    def others(self) -> list[Run]:
        return [r for r in self.runs if r is not self.ref]


def pair_runs(run_dirs: list[Path], base: str = "dense") -> Paired:
    """Load run directories and keep the samples (task, length, depth, seed) present in all; the base
    run is the one named `base`, else the first. Refuses runs whose prompts differ (PROMPT_FIELDS)."""
    runs = [load_run(d) for d in run_dirs]
    for f in PROMPT_FIELDS:
        seen = {str(r.meta.get(f)) for r in runs}
        if len(seen) > 1:
            raise ValueError(f"the runs differ in {f} ({', '.join(f'{r.path}: {r.meta.get(f)}' for r in runs)}), "
                             "so their prompts differ and cannot be compared sample by sample; rerun with matching "
                             "settings")
    names = [r.name for r in runs]
    if len(set(names)) != len(names):  # two runs of one strategy: tell them apart by directory
        for r in runs:
            r.name = f"{r.name} ({r.path.name})"
    ref = next((r for r in runs if r.name == base or r.name.startswith(base + " (")), runs[0])
    common = set.intersection(*({row_key(row) for row in r.rows} for r in runs))
    if not common:
        raise ValueError("the runs share no samples (task, length, depth, seed): were they made with the same "
                         "--tasks/--lengths/--depths/--seed?")
    kept = {r.name: [row for row in r.rows if row_key(row) in common] for r in runs}
    return Paired(runs, ref, common, kept)


def _right(row: dict) -> bool:
    """Answered right: every expected answer found (score 1; partial credit does not count)."""
    return row["score"] >= 1.0


def mcnemar_p(b: int, c: int) -> float:
    """Exact McNemar test, two-sided: how likely a split of the b + c discordant samples at least this uneven
    is if either run were as likely to be the right one (binomial, 1/2). Exact: a cell's few discordant samples
    are where the chi-square approximation is off."""
    n = b + c
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2 ** n)


# Why a strategy missed an answer the reference got (loss_class), in the order the tables show them.
LOSS_CLASSES = ("absent", "distractor", "wrong value", "format", "partial")
# A number, its thousands possibly split by a separator ("1,600,074", "1600 074"); a UUID with or without
# dashes; a variable name (five capitals).
_NUMBER = re.compile(r"\d+(?:[ ,.'\u2009\u202f]\d{3}(?!\d))*")
_UUID = re.compile(r"[0-9a-f]{8}(?:[-\s]?[0-9a-f]{4}){3}[-\s]?[0-9a-f]{12}", re.I)
_NAME = re.compile(r"\b[A-Z]{5}\b")


def _norm(s: str) -> str:
    return re.sub(r"[^0-9a-z]", "", s.lower())


def _candidates(row: dict) -> set[str]:
    """The output's answer-like tokens, normalised: tokens shaped like the expected answers (numbers within
    two digits of their length, UUIDs, variable names, the task's value words)."""
    answers, out = row.get("answers") or [], row.get("output") or ""
    if not answers:
        return set()
    a = answers[0]
    if a.isdigit():
        return {t for t in map(_norm, _NUMBER.findall(out)) if abs(len(t) - len(a)) <= 2}
    if _UUID.fullmatch(a):
        return set(map(_norm, _UUID.findall(out)))
    if _NAME.fullmatch(a):
        return set(map(_norm, _NAME.findall(out)))
    vocab = set(tasks._CWE_WORDS if row["task"] == "common_words" else tasks._VALUE_WORDS)
    vocab |= {_norm(x) for x in answers + (row.get("distractors") or [])}
    return {w for w in re.findall(r"[a-z]+", out.lower()) if w in vocab}


def loss_class(row: dict) -> str:
    """Why this row is not right (LOSS_CLASSES): every answer there once separators are dropped ("format": the
    scorer missed them), some of several ("partial"), no answer-like token at all ("absent"), another needle's
    value ("distractor": only rows that record `distractors`), else some other value ("wrong value"). A row
    rebuilt from outcomes carries the class it was given when its output was there."""
    if row.get("loss"):
        return row["loss"]
    answers, cands = row.get("answers") or [], _candidates(row)
    hits = [raw or _norm(a) in cands for a, raw in zip(answers, found(answers, row.get("output") or ""))]
    if hits and all(hits):
        return "format"
    if any(hits):
        return "partial"
    if not cands:
        return "absent"
    if cands & {_norm(d) for d in row.get("distractors") or []}:
        return "distractor"
    return "wrong value"


def kept_stats(ref_rows: list[dict], rows: list[dict]) -> dict:
    """Sample by sample against the reference: of the `of` samples it answers right, `right` are right
    here too (`kept` = right / of, None when of = 0); `gained`: right here where the reference missed.
    `b` / `c` the discordant samples (reference right and this wrong / the reverse), `mcnemar_p` whether
    they differ by more than chance, `losses` the b samples by loss_class."""
    mine = {row_key(r): r for r in rows}
    ref_right = [row_key(r) for r in ref_rows if _right(r)]
    ref_wrong = [row_key(r) for r in ref_rows if not _right(r)]
    right = sum(_right(mine[k]) for k in ref_right)
    gained = sum(_right(mine[k]) for k in ref_wrong)
    losses = dict.fromkeys(LOSS_CLASSES, 0)
    for k in ref_right:
        if not _right(mine[k]):
            losses[loss_class(mine[k])] += 1
    b = len(ref_right) - right
    return {"n": len(ref_rows), "of": len(ref_right), "right": right,
            "kept": right / len(ref_right) if ref_right else None, "gained": gained,
            "b": b, "c": gained, "mcnemar_p": mcnemar_p(b, gained), "losses": losses}


def _cells(rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """(task, length) -> rows, plus ("all", length) and ("all", "all")."""
    out: dict = defaultdict(list)
    for r in rows:
        for key in ((r["task"], str(r["length"])), ("all", str(r["length"])), ("all", "all")):
            out[key].append(r)
    return out


def _cell_order(keys) -> list[tuple[str, str]]:
    return sorted(keys, key=lambda k: (k[0] == "all", k[0], k[1] == "all", int(k[1]) if k[1].isdigit() else 0))


def _seconds(rows: list[dict], field: str) -> float | None:
    """Median of a per-sample metric (the first sample of a run carries the kernels' compilation)."""
    xs = sorted(float(r["metrics"][field]) for r in rows if (r.get("metrics") or {}).get(field) is not None)
    if not xs:
        return None
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2


def compare_summary(run_dirs: list[Path], base: str = "dense") -> dict:
    """compare_table's numbers as JSON: per run its accuracy per (task, length) on the common samples,
    its paired `kept` share against the reference (kept_stats) and its median prefill / decode seconds
    per length."""
    p = pair_runs(run_dirs, base)
    ref_cells = _cells(p.kept[p.ref.name])
    out = {"reference": p.ref.name, "samples": len(p.common), "runs": {}}
    for r in p.runs:
        cells = _cells(p.kept[r.name])
        entry = {"path": str(r.path), "strategy": r.meta.get("strategy"), "engine": r.meta.get("engine"),
                 "seconds": r.meta.get("seconds"), "prompt_seconds": r.meta.get("prompt_seconds"),
                 "left_out": len(r.rows) - len(p.kept[r.name]), "accuracy": {}, "paired": {},
                 "prefill_seconds": {}, "decode_seconds": {}}
        for task, L in _cell_order(cells):
            rows = cells[(task, L)]
            entry["accuracy"].setdefault(task, {})[L] = _mean([x["score"] for x in rows])
            if r is not p.ref:
                entry["paired"].setdefault(task, {})[L] = kept_stats(ref_cells[(task, L)], rows)
            if task == "all":
                for f in ("prefill_seconds", "decode_seconds"):
                    entry[f][L] = _seconds(rows, f)
        out["runs"][r.name] = entry
    return out


def compare_table(run_dirs: list[Path], base: str = "dense") -> str:
    """Markdown: each strategy's accuracy and its ratio to the base run (the one named `base`, else
    the first), per task and per length; then, sample by sample, the share of the samples the base
    answers right that each strategy answers right too, per task and length, with the exact McNemar p; then
    those losses by class (loss_class) per length; then the median prefill seconds per length where the runs
    recorded them. Paired: only samples present in every run count, so every strategy is scored on the same
    prompts."""
    p = pair_runs(run_dirs, base)
    ref, kept, others = p.ref, p.kept, p.others

    def table(group: str, label: str) -> list[str]:
        acc = {name: _by(rows, group) for name, rows in kept.items()}
        overall = {name: _mean([row["score"] for row in rows]) for name, rows in kept.items()}
        head = f"| {label} | {ref.name} | " + " | ".join(f"{o.name} | ratio" for o in others) + " |"
        lines = [head, "|---|---:|" + "---:|---:|" * len(others)]
        groups = sorted(acc[ref.name], key=lambda k: (not k.isdigit(), int(k) if k.isdigit() else k))
        for g, a in [(g, {n: acc[n][g] for n in acc}) for g in groups] + [("**overall**", overall)]:
            cells = [_pct(a[ref.name])]
            for o in others:
                ratio = a[o.name] / a[ref.name] if a[ref.name] else float("nan")
                cells += [_pct(a[o.name]), "–" if math.isnan(ratio) else f"{ratio:.2f}"]
            lines.append(f"| {g} | " + " | ".join(cells) + " |")
        return lines

    def kept_table() -> list[str]:
        ref_cells = _cells(kept[ref.name])
        cells = {o.name: _cells(kept[o.name]) for o in others}
        lines = [f"Paired on {ref.name}: of the samples {ref.name} answers right, the share each strategy answers "
                 f"right too (right / {ref.name}-right); +N: right where {ref.name} missed; p: exact McNemar test "
                 f"(two-sided) of those two counts, small when the strategy differs from {ref.name} beyond chance.",
                 "",
                 f"| task | length | n | {ref.name} | " + " | ".join(f"{o.name} | kept | p" for o in others) + " |",
                 "|---|---|---:|---:|" + "---:|---:|---:|" * len(others)]
        for task, L in _cell_order(ref_cells):
            rows = ref_cells[(task, L)]
            row = [task if task != "all" else "**all tasks**", L, str(len(rows)), _pct(_mean([x["score"] for x in rows]))]
            for o in others:
                st = kept_stats(rows, cells[o.name][(task, L)])
                k = "–" if st["kept"] is None else f"{100 * st['kept']:.1f} ({st['right']}/{st['of']})"
                row += [_pct(_mean([x["score"] for x in cells[o.name][(task, L)]])),
                        k + (f" +{st['gained']}" if st["gained"] else ""), f"{st['mcnemar_p']:.2g}"]
            lines.append("| " + " | ".join(row) + " |")
        return lines

    def loss_table() -> list[str]:
        ref_cells = _cells(kept[ref.name])
        lengths = sorted({L for _, L in ref_cells if L != "all"}, key=int) + ["all"]
        lines = [f"Losses ({ref.name} right, strategy wrong), classified. absent: no answer-like token in the "
                 "output; distractor: another needle's value; wrong value: some other answer-like token; format: "
                 "every answer there once separators are dropped (1,600,074), which the scorer does not do; partial: "
                 "some of several answers. distractor needs rows that record `distractors`: without them such an "
                 "answer counts as wrong value."]
        if not any("distractors" in r or r.get("loss") for o in others for r in kept[o.name]):
            lines[0] += " These runs record none."
        lines += ["", "| strategy | length | losses | " + " | ".join(LOSS_CLASSES) + " |",
                  "|---|---|---:|" + "---:|" * len(LOSS_CLASSES)]
        for o in others:
            cells = _cells(kept[o.name])
            for L in lengths:
                st = kept_stats(ref_cells[("all", L)], cells[("all", L)])
                counts = " | ".join(str(st["losses"][c]) for c in LOSS_CLASSES)
                lines.append(f"| {o.name} | {L} | {st['b']} | {counts} |")
        return lines

    def speed_table() -> list[str]:
        lengths = sorted({str(r["length"]) for r in kept[ref.name]}, key=int)
        med = {n: {L: _seconds([r for r in rows if str(r["length"]) == L], "prefill_seconds") for L in lengths}
               for n, rows in kept.items()}
        if all(v is None for m in med.values() for v in m.values()):
            return []
        lines = ["Prefill seconds per sample (median over the common samples; ratio = strategy / "
                 f"{ref.name}):", "", f"| length | {ref.name} | " + " | ".join(f"{o.name} | ratio" for o in others) + " |",
                 "|---|---:|" + "---:|---:|" * len(others)]
        for L in lengths:
            b = med[ref.name][L]
            row = [L, "–" if b is None else f"{b:.3f}"]
            for o in others:
                v = med[o.name][L]
                row += ["–" if v is None else f"{v:.3f}", f"{v / b:.2f}" if v is not None and b else "–"]
            lines.append("| " + " | ".join(row) + " |")
        return [""] + lines

    dropped = {r.name: len(r.rows) - len(kept[r.name]) for r in p.runs if len(r.rows) != len(kept[r.name])}
    note = f"Accuracy % on the {len(p.common)} samples common to all runs; ratio = strategy / {ref.name}."
    if dropped:
        note += " Left out (not in every run): " + ", ".join(f"{n}: {k}" for n, k in dropped.items()) + "."
    paired = [""] + kept_table() + [""] + loss_table() if others else []
    return "\n".join([note, ""] + table("task", "task") + [""] + table("length", "length") + paired + speed_table())


# ---------------------------------------------------------------------------------------------
# Outcomes: every sample's result in a few characters

# A sample's code: right, or why not (loss_class), one letter each.
_CODE = {"right": "R", "absent": "a", "distractor": "d", "wrong value": "w", "format": "f", "partial": "p"}
_CLASS = {v: k for k, v in _CODE.items()}


def outcomes(rows: list[dict]) -> dict:
    """{"task|length|depth": {"seeds": [[first, last], ...], "codes": one _CODE letter per seed in order,
    "scores": {position: score}} for the scores that are neither 0 nor 1}. Enough to pair (row_key, score,
    loss class) and to summarize; depth "-" for depth-less tasks."""
    cells: dict = defaultdict(list)
    for r in rows:
        task, length, depth, seed = row_key(r)
        cells[f"{task}|{length}|{'-' if depth is None else repr(float(depth))}"].append((seed, r))
    out = {}
    for key in sorted(cells):
        items = sorted(cells[key], key=lambda x: x[0])
        seeds = [s for s, _ in items]
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"cell {key} holds a seed twice: one row per sample")
        ranges = []
        for s in seeds:
            if ranges and s == ranges[-1][1] + 1:
                ranges[-1][1] = s
            else:
                ranges.append([s, s])
        codes = "".join(_CODE["right" if _right(r) else loss_class(r)] for _, r in items)
        scores = {str(i): r["score"] for i, (_, r) in enumerate(items) if r["score"] not in (0, 1)}
        out[key] = {"seeds": ranges, "codes": codes, **({"scores": scores} if scores else {})}
    return out


def outcome_rows(cells: dict) -> list[dict]:
    """outcomes' rows back: {task, length, depth, seed, score, loss} (loss None where right)."""
    rows = []
    for key, cell in cells.items():
        task, length, depth = key.split("|")
        seeds = [s for a, b in cell["seeds"] for s in range(a, b + 1)]
        codes, scores = cell["codes"], cell.get("scores", {})
        if len(codes) != len(seeds):
            raise ValueError(f"outcomes cell {key}: {len(codes)} codes for {len(seeds)} seeds")
        for i, (seed, c) in enumerate(zip(seeds, codes)):
            rows.append({"task": task, "length": int(length), "depth": None if depth == "-" else float(depth),
                         "seed": seed, "score": scores.get(str(i), 1.0 if c == "R" else 0.0),
                         "loss": None if c == "R" else _CLASS[c]})
    return rows


# ---------------------------------------------------------------------------------------------
# Heat maps


def heatmap(summary: dict, title: str, out: Path, task: str | None = None) -> bool:
    """Length x depth accuracy as a PNG (all needle tasks, or one `task`); False, writing nothing, if
    matplotlib is missing or there is nothing with a depth to plot."""
    grid = summary["by_length_depth"] if task is None else summary["by_task_length_depth"].get(task, {})
    if not grid:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    lengths = sorted(grid, key=int)
    depths = sorted({dp for d in grid.values() for dp in d}, key=float)
    data = [[100 * grid[L].get(dp, float("nan")) for L in lengths] for dp in depths]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.6 + 0.9 * len(lengths)), 1.6 + 0.45 * len(depths)))
    im = ax.imshow(data, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(lengths)), lengths)
    ax.set_yticks(range(len(depths)), [f"{float(d):.2f}" for d in depths])
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("needle depth")
    for i, row in enumerate(data):
        for j, v in enumerate(row):
            ax.text(j, i, "–" if math.isnan(v) else f"{v:.0f}", ha="center", va="center", fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax, label="accuracy %")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------------------------
# A run directory


def write_run(out: Path, rows: list[dict], meta: dict, per_task_heatmaps: bool = True) -> dict:
    """samples.jsonl, summary.json ({**meta, "summary"}), table.md, heatmap.png (+ heatmap_<task>.png).
    Returns the summary; prints nothing (a missing matplotlib shows as summary["heatmaps"] == [])."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "samples.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    summary = summarize(rows)
    name = meta.get("strategy", "run")
    (out / "table.md").write_text(task_table(summary, name) + "\n")
    maps = []
    if heatmap(summary, f"{name}: needle tasks\naccuracy by length and depth", out / "heatmap.png"):
        maps.append("heatmap.png")
    if maps and per_task_heatmaps:
        for task in summary["by_task_length_depth"]:
            if heatmap(summary, f"{name}: {task}", out / f"heatmap_{task}.png", task=task):
                maps.append(f"heatmap_{task}.png")
    full = {**meta, "heatmaps": maps, "summary": summary, "outcomes": outcomes(rows)}
    (out / "summary.json").write_text(json.dumps(full, indent=1) + "\n")
    return summary
