"""Accuracy harness: seeded RULER-style synthetic tasks through any engine configuration.

    python launch/eval.py --lengths 1024,2048 --samples-per-cell 2 --out runs/dense
    torchrun --nproc-per-node 2 launch/eval.py --cp 2 --cp-strategy star --out runs/star
    python launch/eval.py --compare runs/dense runs/star          # strategy vs dense table

Lengths are whole sequences in model tokens: context + question + prompt template + the answer
budget (--max-new-tokens), so 8192 fits an 8K window. Runs with the same --lengths, depths, --seed,
--format and --max-new-tokens see the same prompts, so --compare pairs them sample by sample.

--compare adds, sample by sample, the share of the samples dense answers right that each strategy
answers right too ("kept", per task and length) and the median prefill seconds per length; with
--out it writes compare.md and compare.json (the same numbers) there.

Writes to --out: samples.jsonl (each sample's output and score), summary.json (accuracy per task,
length and depth, and each sample's outcome: its score and why it missed, a letter each), table.md,
heatmap.png (length x depth, needle tasks) and heatmap_<task>.png. A directory holding only a run's
summary.json (e.g. kept in a repository) still compares (--compare) and resumes (--resume).
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import sys
import time
from pathlib import Path

from starshard.cli import (add_fp8_arguments, add_layout_arguments, add_rope_scaling_argument, add_sparse_arguments,
                           default_strategy, fp8_config, sparse_config, strategy_cli_error)
from starshard.config import ParallelConfig
from starshard.evaluation import report
from starshard.evaluation.scoring import found, score
from starshard.evaluation.tasks import TASKS, TASKS_VERSION, make_samples, parse_tasks, template_overhead
from starshard.llm import LLM
from starshard.strategies import OPTIONS

# Engine flags passed on to LLM(...) only when given (not at their defaults); the engine decides what
# it supports. OPTIONS: every context strategy's options (the registry's).
ENGINE_FLAGS = ("tp", "pp", "cp", "cp_strategy", "pp_layers", *OPTIONS, "sparse", "fp8", "rope_scaling")


def _flag_defaults() -> dict:
    ap = argparse.ArgumentParser()
    add_layout_arguments(ap)
    add_sparse_arguments(ap)
    add_fp8_arguments(ap)
    add_rope_scaling_argument(ap)
    return {k: ap.get_default(k) for k in ENGINE_FLAGS}


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="starshard checkpoint dir, HF model dir or .gguf (default: embedded SmolLM2-135M-Instruct)")
    t = ap.add_argument_group("tasks")
    t.add_argument("--tasks", default=",".join(TASKS),
                   help="comma-separated tasks (default: all). " + "; ".join(f"{k}: {v.description}" for k, v in TASKS.items()))
    t.add_argument("--lengths", type=_ints, default=[1024, 2048, 4096, 8192], metavar="N,N,..",
                   help="sequence lengths in model tokens, prompt + answer (default: 1024,2048,4096,8192)")
    t.add_argument("--depths", type=_floats, default=None, metavar="D,D,..",
                   help="needle depths in [0, 1], e.g. 0,0.25,0.5,0.75,1 (overrides --num-depths)")
    t.add_argument("--num-depths", type=int, default=5, help="needle depths spread evenly over [0, 1] (default: 5)")
    t.add_argument("--samples-per-cell", type=int, default=1,
                   help="samples per (task, length, depth) cell, each with its own seed (default: 1)")
    t.add_argument("--seed", type=int, default=0, help="task generator seed (default: 0)")
    t.add_argument("--sample-workers", type=int, default=min(8, os.cpu_count() or 1), metavar="N",
                   help="threads that make the prompts before the model runs (sizing a prompt to its length "
                        "tokenizes it a few times: ~0.3 s a 30K-token prompt on one core); the prompts are the "
                        "same for any N (default: min(8, CPU cores))")
    g = ap.add_argument_group("generation")
    g.add_argument("--max-new-tokens", type=int, default=64,
                   help="answer budget per sample, greedy; chat answers restate the question (default: 64)")
    g.add_argument("--format", choices=["chat", "completion"], default="chat",
                   help="chat: the model's chat template around context + question (default). completion: no "
                        "template, the question followed by the task's answer cue (\"The pass key is\"), which "
                        "small models answer more reliably")
    o = ap.add_argument_group("output")
    o.add_argument("--out", type=Path, default=None,
                   help="run directory: samples.jsonl, summary.json, table.md, heatmap PNGs (with --compare: "
                        "where compare.md goes)")
    o.add_argument("--strategy-name", default=None,
                   help="label of this run in tables and plots (default: --cp-strategy, else dense)")
    o.add_argument("--compare", type=Path, nargs="+", default=None, metavar="DIR",
                   help="no model run: print the strategy-vs-dense table (accuracy and ratio to the run labelled "
                        "dense, else the first) of these run directories, paired on their common samples")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="start no new sample S seconds after the command started (loading and prompt making "
                        "count) and write what ran (summary.json says "
                        "\"stopped_early\"); samples run seed by seed over every cell, so a cut run keeps a "
                        "balanced share of each task, length and depth (one process only: not under torchrun)")
    o.add_argument("--resume", action="store_true",
                   help="keep the samples --out already holds (a run of the same strategy and prompts, e.g. cut by "
                        "--time-limit in an earlier session) and run only the others: the directory then holds "
                        "both, as one run. Its summary.json alone is enough (the samples' outcomes; their "
                        "outputs are then not kept)")
    add_layout_arguments(ap)  # the same layout and sparse flags as launch/infer.py, passed on only when given
    add_sparse_arguments(ap)
    add_fp8_arguments(ap)
    add_rope_scaling_argument(ap)
    e = ap.add_argument_group("engine")
    e.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    e.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="compute dtype (default: bfloat16 on cuda, float32 on cpu)")
    args = ap.parse_args(argv)
    if args.compare:
        return args
    if args.out is None:
        ap.error("--out DIR is required (or --compare DIR ...)")
    bad = strategy_cli_error(args)  # --sparse-config without --sparse: build_llm says so
    if bad:
        ap.error(bad)
    try:
        fp8_config(args)
    except ValueError as e:
        ap.error(str(e))
    try:
        args.tasks = parse_tasks(args.tasks)
    except ValueError as e:
        ap.error(str(e))
    if args.depths is None:
        if args.num_depths < 1:
            ap.error("--num-depths must be >= 1")
        args.depths = [round(i / max(1, args.num_depths - 1), 4) for i in range(args.num_depths)]
    if not args.depths or not all(0 <= d <= 1 for d in args.depths):
        ap.error(f"--depths must lie in [0, 1], got {args.depths}")
    if not args.lengths or min(args.lengths) <= 0 or args.samples_per_cell < 1 or args.max_new_tokens < 1:
        ap.error("--lengths, --samples-per-cell and --max-new-tokens must be positive")
    if args.time_limit is not None and args.time_limit < 0:
        ap.error(f"--time-limit must be >= 0 seconds, got {args.time_limit}")
    if args.sample_workers < 1:
        ap.error(f"--sample-workers must be >= 1, got {args.sample_workers}")
    return args


def engine_flags(args) -> dict:
    defaults = _flag_defaults()
    flags = {k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k) != defaults[k]}
    if getattr(args, "sparse_config", None) is not None and "sparse" not in flags:
        raise SystemExit("error: --sparse-config needs --sparse minference")
    if "sparse" in flags:
        try:
            flags["sparse"] = sparse_config(args)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
    if "fp8" in flags:
        flags["fp8"] = fp8_config(args)
    return flags


def build_llm(args, llm_cls=None):
    """LLM(--model, engine flags given, device, dtype). Flags that LLM(...) does not take itself go into
    its `parallel` ParallelConfig; a flag neither takes is refused with a message naming it."""
    if llm_cls is None:
        llm_cls = LLM
    params = inspect.signature(llm_cls).parameters
    open_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    takes = lambda k: open_kw or k in params  # noqa: E731
    kwargs: dict = {}
    if takes("device") or takes("dtype"):
        import torch

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
        kwargs.update({k: v for k, v in (("device", device), ("dtype", getattr(torch, dtype))) if takes(k)})
    if takes("progress"):
        kwargs["progress"] = False
    layout = {}
    for k, v in engine_flags(args).items():
        if takes(k):
            kwargs[k] = v
        else:
            layout[k] = v
    if layout:
        fields = {f.name for f in dataclasses.fields(ParallelConfig)}
        missing = [k for k in layout if k not in fields]
        if missing or "parallel" not in params:
            flags = ", ".join("--" + k.replace("_", "-") for k in (missing or layout))
            raise SystemExit(f"error: this engine does not support {flags} yet (LLM(...) and ParallelConfig take no "
                             f"such argument)")
        try:
            kwargs["parallel"] = ParallelConfig(**layout)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
    try:
        return llm_cls(args.model, **kwargs)
    except TypeError as e:
        if "unexpected keyword" in str(e):
            raise SystemExit(f"error: the engine rejected the flags {sorted(kwargs)}: {e}") from e
        raise


def evaluate(llm, samples, *, chat: bool, max_new_tokens: int, progress: bool = True, label: str = "eval",
             deadline: float | None = None) -> list[dict]:
    """Run every sample through llm.generate (greedy) and score it; one row per sample. With a
    `deadline` (time.time()) no sample starts after it: the rows of those that ran."""
    from tqdm import tqdm

    rows, total = [], 0.0
    bar = tqdm(samples, desc=label, unit="sample", disable=not progress, dynamic_ncols=True)
    for s in bar:
        if deadline is not None and time.time() > deadline:
            break
        kw = dict(context=s.context, question=s.question, max_new_tokens=max_new_tokens, temperature=0.0)
        if not chat:  # the question goes on as the query, the answer cue at its end
            kw.update(question=f"{s.question} {s.answer_prefix}".strip(), raw=True)
        out = llm.generate(**kw)
        sc = score(s.answers, s.metric, out.text)
        total += sc
        metrics = dict(getattr(out, "metrics", None) or {})
        rows.append({"task": s.task, "length": s.length, "depth": s.depth, "seed": s.seed, "metric": s.metric,
                     "question": s.question, "answers": s.answers, "distractors": s.distractors,
                     "needle_spans": s.needle_spans,
                     "target_tokens": s.target_tokens, "prompt_tokens": metrics.get("prompt_tokens"),
                     "output": out.text, "found": found(s.answers, out.text), "score": sc, "metrics": metrics})
        bar.set_postfix(acc=f"{100 * total / len(rows):.0f}%")
    return rows


def resumed_rows(args, model: str, name: str, reserve: int) -> list[dict]:
    """The rows --out holds already (--resume), refused unless they are this run's strategy and prompts. Another
    model path is only warned about: a converted GGUF's cache path changes with the file's mtime."""
    if not report.is_run(args.out):
        return []
    run = report.load_run(args.out)
    now = {"strategy": name, "tasks_version": TASKS_VERSION, "format": args.format, "reserve_tokens": reserve}
    differ = [f"{k} {run.meta.get(k)!r} there, {v!r} here" for k, v in now.items() if run.meta.get(k) != v]
    if differ:
        raise SystemExit(f"error: --resume: {args.out} holds another run ({'; '.join(differ)}): give another --out")
    if run.meta.get("model") != model:
        print(f"warning: --resume: {args.out}'s samples came from {run.meta.get('model')}, these from {model}; "
              "they are kept as one run", file=sys.stderr)
    return run.rows


def main(argv=None, llm_cls=None) -> int:
    started = time.time()
    args = parse_args(argv)

    if args.compare:
        table = report.compare_table(args.compare)
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "compare.md").write_text(table + "\n")
            summary = report.compare_summary(args.compare)
            (args.out / "compare.json").write_text(json.dumps(summary, indent=1) + "\n")
        print(table)
        return 0

    llm = build_llm(args, llm_cls)
    topo = getattr(llm, "topology", None)
    lead = getattr(topo, "rank", 0) == 0  # under torchrun every rank runs the model; rank 0 reports
    tok = getattr(llm, "tokenizer", None)
    if tok is None:
        raise SystemExit("error: the model has no tokenizer; the tasks are text and need one")
    window = getattr(getattr(llm, "config", None), "max_position_embeddings", None)
    if window is not None and max(args.lengths) > window:
        raise SystemExit(f"error: --lengths {max(args.lengths)} exceeds the model window of {window} tokens")
    chat = args.format == "chat"
    reserve = template_overhead(tok, chat) + args.max_new_tokens
    name = args.strategy_name or default_strategy(args)
    model = str(getattr(llm, "path", args.model))
    kept = resumed_rows(args, model, name, reserve) if args.resume else []
    t0 = time.time()
    samples = make_samples(args.tasks, tok, args.lengths, args.depths, args.samples_per_cell, args.seed, reserve,
                           workers=args.sample_workers, skip={report.row_key(r) for r in kept})
    sample_seconds = time.time() - t0
    # Seed by seed over every (task, length, depth) cell: a run cut by --time-limit stays balanced.
    samples.sort(key=lambda s: s.seed)
    if args.time_limit is not None and getattr(topo, "world_size", 1) > 1:
        raise SystemExit("error: --time-limit stops one process on its own clock; the ranks of a torchrun group "
                         "would stop at different samples: drop it (or run one process, e.g. --cp 1 --num-blocks N)")
    rows = kept + evaluate(llm, samples, chat=chat, max_new_tokens=args.max_new_tokens,
                           progress=lead and not args.no_progress, label=f"eval {name}",
                           deadline=None if args.time_limit is None else started + args.time_limit)
    if not lead:
        return 0
    meta = {"strategy": name, "model": model, "tasks_version": TASKS_VERSION,
            "format": args.format,
            "engine": {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for k, v in engine_flags(args).items()}, "tasks": args.tasks, "lengths": args.lengths, "depths": args.depths,
            "samples_per_cell": args.samples_per_cell, "seed": args.seed, "max_new_tokens": args.max_new_tokens,
            "reserve_tokens": reserve, "seconds": round(time.time() - t0, 1),
            "prompt_seconds": round(sample_seconds, 1),  # of "seconds": making the prompts, before the model ran
            "stopped_early": None if len(rows) == len(kept) + len(samples)
            else f"--time-limit: {len(rows)} of {len(kept) + len(samples)} samples ran",
            "resumed": len(kept),  # samples kept from the directory's earlier run (--resume)
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    summary = report.write_run(args.out, rows, meta)
    if not (args.out / "heatmap.png").is_file() and summary["by_length_depth"]:
        print(report.PLOT_HINT, file=sys.stderr)
    print(report.task_table(summary, name))
    return 0
