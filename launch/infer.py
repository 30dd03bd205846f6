#!/usr/bin/env python
"""starshard main job (`starshard run`, `starshard plan`): run one prompt through a model and print the answer.
The code and its usage: starshard/commands/infer.py. This script is what torchrun and launch/slurm/*.sbatch start."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from starshard.commands.infer import main  # noqa: E402
from starshard.parallel.exit import exit_process  # noqa: E402

if __name__ == "__main__":
    exit_process(main())
