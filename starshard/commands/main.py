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

import importlib
import os
import sys
from dataclasses import dataclass
from importlib import metadata

import starshard  # light: the package root imports nothing until asked (its __getattr__)
from starshard.parallel.exit import exit_process

# Each command's module is imported only when that command runs: `starshard --help` and `--version`
# load neither torch nor the kernels (a second run takes well under a second on 2 cores).


@dataclass(frozen=True)
class Command:
    module: str  # the module whose `main` runs it, imported when the command runs
    summary: str
    argv: tuple[str, ...] = ()  # flags appended to the command's own (plan = run --plan-only)
    tool: bool = False  # an offline tool's main returns its result (a dict), not an exit status
    env: tuple[tuple[str, str], ...] = ()  # environment defaults set before the module loads

    def run(self, argv: list[str]) -> int | None:
        """Parse argv with the command's own flags and run it; the exit status (None = 0)."""
        for key, value in self.env:
            os.environ.setdefault(key, value)
        result = importlib.import_module(self.module).main([*argv, *self.argv])
        return 0 if self.tool else result


COMMANDS = {
    "run": Command("starshard.commands.infer",
                   "run one prompt through a model and print the answer (launch/infer.py)"),
    "plan": Command("starshard.commands.infer",
                    "print the per-rank memory plan and exit, loading nothing (run's flags; run --plan-only)",
                    argv=("--plan-only",)),
    "serve": Command("starshard.commands.serve",
                     "OpenAI-compatible HTTP server over the parallel group (launch/serve.py)"),
    "eval": Command("starshard.commands.eval",
                    "accuracy harness: RULER-style synthetic tasks, --compare runs (launch/eval.py)"),
    # as launch/bench.py: ranks of one host share its cores
    "bench": Command("starshard.commands.bench",
                     "benchmarks -> JSON (+ PNG), one subcommand per benchmark (launch/bench.py)",
                     env=(("OMP_NUM_THREADS", "1"),)),
    "cache": Command("starshard.commands.cache", "list or purge the context cache's disk tier (--disk-cache-dir)"),
    "convert": Command("starshard.checkpoints.convert", "convert a Hugging Face dir or a GGUF file into starshard shards"),
    "fidelity": Command("starshard.commands.fidelity",
                        "per-layer fidelity of approximate attention against dense (launch/fidelity.py)"),
    "minference-search": Command("starshard.tools.minference_search",
                                 "search per-head MInference patterns for a model (--sparse-config JSON)", tool=True),
    "anchor-calibrate": Command("starshard.tools.anchor_calibrate",
                                "calibrate per-head AnchorAttention thresholds (--sparse-config JSON)", tool=True),
}


def version() -> str:
    """The installed package's version (the source tree's __version__ when run from a checkout)."""
    try:
        return metadata.version("starshard")
    except metadata.PackageNotFoundError:
        return starshard.__version__


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {c.summary}" for name, c in COMMANDS.items()]
    return ("usage: starshard <command> [flags]   (starshard <command> --help: that command's flags; "
            "starshard --version)\n\n"
            "commands:\n" + "\n".join(lines))


def dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"starshard {version()}")
        return 0
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
    try:
        code = dispatch(sys.argv[1:])
    except KeyboardInterrupt:  # Ctrl-C before a command handles it (loading torch, a model): no traceback
        print("starshard: interrupted", file=sys.stderr)
        code = 130
    exit_process(code)
