"""Run a Python program with the MInference index build's CUDA default set: `triton` (the launches of
kernels/minference/estimate.py and columns.py, the default since 2026-11-25) or `torch` (the torch ops
before them), to time a bench both ways in one device call:

    python bench/with_index_build.py torch launch/bench.py prefill ...
"""
import runpy
import sys

from starshard.kernels.minference import estimate

if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("torch", "triton"):
        sys.exit("usage: python bench/with_index_build.py {torch,triton} PROGRAM.py [ARGS...]")
    estimate.ON_CUDA_BY_DEFAULT = sys.argv[1] == "triton"
    sys.argv = sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")
