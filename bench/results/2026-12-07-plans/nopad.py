"""launch/bench.py with the cuDNN plan padding off (kernels/attention.py PLAN_PAD_MAX = 0): run.sh's baseline, the
same tree.   python bench/results/2026-12-07-plans/nopad.py launch/bench.py prefill ..."""
import importlib
import runpy
import sys

importlib.import_module("starshard.kernels.attention").PLAN_PAD_MAX = 0
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
