"""Run a launch script with `--fp8 attention` on flash_fp8 variant t instead of s (measurement only:
the library's `--fp8 attention` stays on variant s until this says t keeps accuracy).

    python bench/results/2026-11-26-h200-fp8-pv/with_variant_t.py launch/eval.py --fp8 attention ...
"""
import runpy
import sys

sys.path.insert(0, ".")
import starshard.kernels.attention  # noqa: E402,F401  (the package exports a function of that name: use sys.modules)
import starshard.kernels.flash_fp8 as ff  # noqa: E402

A = sys.modules["starshard.kernels.attention"]
_told = []


def variant_t(q, k, v, *, variant="s", **kw):
    if not _told:
        print(f"with_variant_t: flash_fp8 variant t instead of {variant!r}", file=sys.stderr, flush=True)
        _told.append(1)
    return ff.flash_fp8_attention(q, k, v, variant="t", **kw)


A.flash_fp8_attention = variant_t
script, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_path(script, run_name="__main__")
