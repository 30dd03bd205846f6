"""Combine partial attention results over disjoint key sets by log-sum-exp (exact): kernels/merge.py,
re-exported for the context strategies."""
from __future__ import annotations

from starshard.kernels.merge import merge_into, merge_partials

__all__ = ["merge_into", "merge_partials"]
