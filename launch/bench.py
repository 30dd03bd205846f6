#!/usr/bin/env python
"""Benchmarks -> JSON (+ PNG) (`starshard bench`): one subcommand per benchmark.
The code and its usage: starshard/commands/bench.py. This script is what torchrun and launch/slurm/*.sbatch start."""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from starshard.commands.bench import main  # noqa: E402
from starshard.parallel.exit import exit_process  # noqa: E402

if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    exit_process(main())
