"""`starshard <command> [flags]`: one program for every job, as `vllm serve`.

    starshard run --model CKPT --prompt "..."                    # launch/infer.py
    starshard plan --random-weights llama-3.1-8b --prompt-len 131072 --tp 2   # the memory plan, loads nothing
    starshard serve --model CKPT --port 8000                      # launch/serve.py
    starshard eval --lengths 1024,2048 --out runs/dense            # launch/eval.py
    starshard bench prefill --random-weights llama-3.1-8b ...      # launch/bench.py
    starshard convert --hf DIR --out CKPT --tp 2                   # python -m starshard.checkpoints.convert
    starshard cache list --disk-cache-dir DIR                      # the disk tier's files; cache purge removes them
    torchrun --nproc-per-node 4 -m starshard run --tp 2 --pp 2 ... # every rank runs the same command

Each command parses its own flags, so `starshard <command> --help` is that command's full help.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from starshard.checkpoints import convert
from starshard.commands import bench, cache, fidelity, infer, serve
from starshard.commands import eval as accuracy
from starshard.parallel.exit import exit_process
from starshard.tools import anchor_calibrate, minference_search


def plan(argv: list[str]) -> int:
    """`starshard plan ...` is `starshard run ... --plan-only`: the per-rank memory plan, nothing loaded."""
    return infer.main([*argv, "--plan-only"])


def tool(main: Callable[[list[str]], dict]) -> Callable[[list[str]], int]:
    """An offline tool's main, which returns its result (a dict) rather than an exit status."""
    def run(argv: list[str]) -> int:
        main(argv)
        return 0
    return run


def benchmark(argv: list[str]) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as launch/bench.py: ranks of one host share its cores
    bench.main(argv)


@dataclass(frozen=True)
class Command:
    run: Callable[[list[str]], int | None]  # parses argv itself; the exit status (None = 0)
    summary: str


COMMANDS = {
    "run": Command(infer.main, "run one prompt through a model and print the answer (launch/infer.py)"),
    "plan": Command(plan, "print the per-rank memory plan and exit, loading nothing (run's flags; run --plan-only)"),
    "serve": Command(serve.main, "OpenAI-compatible HTTP server over the parallel group (launch/serve.py)"),
    "eval": Command(accuracy.main, "accuracy harness: RULER-style synthetic tasks, --compare runs (launch/eval.py)"),
    "bench": Command(benchmark, "benchmarks -> JSON (+ PNG), one subcommand per benchmark (launch/bench.py)"),
    "cache": Command(cache.main, "list or purge the context cache's disk tier (--disk-cache-dir)"),
    "convert": Command(convert.main, "convert a Hugging Face dir or a GGUF file into starshard shards"),
    "fidelity": Command(fidelity.main, "per-layer fidelity of approximate attention against dense (launch/fidelity.py)"),
    "minference-search": Command(tool(minference_search.main),
                                 "search per-head MInference patterns for a model (--sparse-config JSON)"),
    "anchor-calibrate": Command(tool(anchor_calibrate.main),
                                "calibrate per-head AnchorAttention thresholds (--sparse-config JSON)"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {c.summary}" for name, c in COMMANDS.items()]
    return ("usage: starshard <command> [flags]   (starshard <command> --help: that command's flags)\n\n"
            "commands:\n" + "\n".join(lines))


def dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    command = COMMANDS.get(name)
    if command is None:
        print(f"starshard: error: unknown command {name!r}; the commands are {', '.join(COMMANDS)} "
              "(starshard --help says what each does)", file=sys.stderr)
        return 2
    script = sys.argv[0]
    sys.argv[0] = f"starshard {name}"  # argparse names the program after argv[0]: `usage: starshard run ...`
    try:
        return command.run(rest) or 0
    finally:
        sys.argv[0] = script


def main(argv: list[str] | None = None) -> int:
    """The console script `starshard` (and `python -m starshard`). Called with no argv it is the process's
    entry point and leaves through exit_process, as launch/*.py do (parallel/exit.py says why)."""
    if argv is not None:
        return dispatch(list(argv))
    exit_process(dispatch(sys.argv[1:]))
