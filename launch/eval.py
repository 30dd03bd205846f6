#!/usr/bin/env python
"""Accuracy harness: RULER-style synthetic tasks through any engine configuration.

    python launch/eval.py --lengths 1024,2048 --samples-per-cell 2 --out runs/dense
    torchrun --nproc-per-node 4 launch/eval.py --cp 4 --cp-strategy star --out runs/star
    python launch/eval.py --compare runs/dense runs/star          # strategy vs dense table

Writes samples.jsonl (every prompt's answer and score), summary.json, table.md and heatmap.png.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from starshard.evaluation.tasks import TASKS  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint / HF dir / .gguf (default: embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated tasks (default all: {', '.join(TASKS)})")
    ap.add_argument("--lengths", default="1024,2048,4096,8192", help="comma-separated prompt lengths in model tokens")
    ap.add_argument("--num-depths", type=int, default=3, help="needle depths spread evenly over 0..1")
    ap.add_argument("--samples-per-cell", type=int, default=1, help="samples per (task, length, depth)")
    ap.add_argument("--seed", type=int, default=0, help="task generator seed")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="answer budget per sample")
    ap.add_argument("--chat", action="store_true",
                    help="wrap prompts in the chat template (default: completion format ending with the task's "
                         "answer cue, which small models answer far more reliably)")
    ap.add_argument("--out", type=Path, default=None, help="output directory")
    ap.add_argument("--strategy-name", default=None, help="label in tables (default: the --cp-strategy)")
    ap.add_argument("--compare", type=Path, nargs="+", default=None, help="only print the strategy-vs-dense table of these run dirs")
    ap.add_argument("--cp", type=int, default=1, help="context-parallel size (launch with torchrun)")
    ap.add_argument("--cp-strategy", default=None, choices=["dense", "ring", "ulysses", "star"], help="context strategy")
    ap.add_argument("--block-size", type=int, default=None, help="star: block size")
    ap.add_argument("--anchor-size", type=int, default=None, help="star: anchor size")
    ap.add_argument("--device", default=None, help="cpu or cuda")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="compute dtype")
    args = ap.parse_args(argv)
    if not args.compare and args.out is None:
        ap.error("--out DIR is required (or --compare DIR ...)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from starshard.evaluation import report

    if args.compare:
        print(report.compare_table(args.compare))
        return 0
    import torch
    from tqdm import tqdm

    from starshard import LLM
    from starshard.config import ParallelConfig
    from starshard.evaluation.scoring import score
    from starshard.evaluation.tasks import make_samples

    strategy = args.cp_strategy or ("dense" if args.cp == 1 else "ring")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.startswith("cuda") else "float32"))
    parallel = ParallelConfig(cp=args.cp, cp_strategy=strategy, block_size=args.block_size, anchor_size=args.anchor_size)
    llm = LLM(args.model, dtype=dtype, device=device, parallel=parallel, progress=False)
    lead = llm.topology.rank == 0
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [round(i / max(1, args.num_depths - 1), 3) for i in range(args.num_depths)]
    tasks = [t for t in args.tasks.split(",") if t]
    samples = make_samples(tasks, llm.tokenizer, lengths, depths, args.samples_per_cell, args.seed)
    rows = []
    for s in tqdm(samples, desc=f"eval {strategy}", disable=not lead):
        question = s.question if args.chat else f"{s.question} {s.answer_prefix}"
        out = llm.generate(context=s.context, question=question, raw=not args.chat, max_new_tokens=args.max_new_tokens)
        rows.append({"task": s.task, "length": s.length, "depth": s.depth, "seed": s.seed,
                     "prompt_tokens": out.prompt_tokens, "answers": s.answers, "output": out.text,
                     "score": score(s.answers, s.metric, out.text)})
    if not lead:
        return 0
    name = args.strategy_name or strategy
    summary = report.summarize(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "samples.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    meta = {"strategy": name, "cp": args.cp, "model": str(llm.path), "chat_template": args.chat, "args": {k: str(v) for k, v in vars(args).items()}}
    (args.out / "summary.json").write_text(json.dumps({**meta, "summary": summary}, indent=1))
    table = report.task_table(summary, name)
    (args.out / "table.md").write_text(table + "\n")
    if not report.heatmap(summary, f"{name}: accuracy by length and depth", args.out / "heatmap.png"):
        print("matplotlib is not installed: no heat map (pip install matplotlib)", file=sys.stderr)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
