#!/usr/bin/env python
"""Attention-level fidelity of approximate attention against dense, per layer (`starshard fidelity`).
The code and its usage: starshard/commands/fidelity.py. This script is what torchrun and launch/slurm/*.sbatch start."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from starshard.commands.fidelity import main  # noqa: E402
from starshard.parallel.exit import exit_process  # noqa: E402

if __name__ == "__main__":
    exit_process(main())
