"""Sparse prefill methods bound to a model's layers: what `--sparse` switches on.

A sparse method covers a whole model (MInference's per-layer, per-head patterns; AnchorAttention's
threshold). Each attention layer holds a `LayerSparse`: the method, the layer's id and the first
query head this rank holds under tensor parallelism. A context strategy asks it for the pattern of
the heads it is about to attend (Ulysses: a slice of the local heads) and passes that pattern to
`attention(..., sparse=pattern)`, which calls `pattern.attention(...)`. Decode steps stay dense.

Strategies that split a row's keys over ranks (ring, USP) refuse a sparse method: the patterns are
estimated from the whole key range of a row, which no ring step sees.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from starshard.kernels.anchor import AnchorConfig
from starshard.kernels.common import DECODE_MAX_ROWS
from starshard.kernels.minference import MInferenceConfig

SPARSE_METHODS = ("minference", "anchor")


class SparseMethod(Protocol):
    def pattern(self, layer: int, num_heads: int, head_offset: int = 0):
        """The `sparse=` spec for `num_heads` query heads starting at global head `head_offset`."""


@dataclass(frozen=True)
class SparseConfig:
    """--sparse METHOD [--sparse-config FILE] [--anchor-theta T --anchor-block-q N --anchor-step S].

    minference: per-head patterns from FILE (default Vertical-Slash 1000/6096 everywhere).
    anchor: AnchorAttention with one threshold for every head (paper: theta 12, 128-row blocks
    pooled, one stripe selection per 16 blocks; small models at a few K tokens need finer pooling)."""

    method: str
    config_path: str | None = None
    anchor_theta: float = 12.0
    anchor_block_q: int = 128
    anchor_step: int = 16

    def __post_init__(self):
        if self.method not in SPARSE_METHODS:
            raise ValueError(f"unknown --sparse {self.method!r}; choose one of {', '.join(SPARSE_METHODS)}")
        if self.method == "anchor" and self.config_path is not None:
            raise ValueError("--sparse-config is for --sparse minference; AnchorAttention takes --anchor-theta")
        if self.config_path is not None and not Path(self.config_path).is_file():
            raise ValueError(f"--sparse-config {self.config_path} does not exist; write one with "
                             "`python -m starshard.tools.minference_search --out FILE` or drop the flag")


@dataclass(frozen=True)
class UniformSparse:
    """One spec for every layer and head (AnchorAttention selects per head at run time)."""

    spec: object

    def pattern(self, layer: int, num_heads: int, head_offset: int = 0):
        return self.spec


def load_sparse_method(cfg: SparseConfig) -> SparseMethod:
    if cfg.method == "anchor":
        return UniformSparse(AnchorConfig(theta=cfg.anchor_theta, block_q=cfg.anchor_block_q, step=cfg.anchor_step))
    # No file: every head uses the default Vertical-Slash (1000 columns, 6096 diagonals).
    return MInferenceConfig.load(cfg.config_path) if cfg.config_path else MInferenceConfig()


@dataclass(frozen=True)
class LayerSparse:
    """One layer's sparse method on this rank; `head_offset` is its first global query head."""

    method: SparseMethod
    layer: int
    head_offset: int = 0

    def heads(self, num_heads: int, offset: int = 0):
        """Pattern for this rank's local heads offset .. offset + num_heads - 1."""
        return self.method.pattern(self.layer, num_heads, self.head_offset + offset)


def pattern_for(sparse: LayerSparse | None, q, offset: int = 0):
    """The `sparse=` argument of one attention call over q [B, H, L, D] (None: dense). Decode-sized
    calls stay dense; the method itself runs short blocks dense too (common.MIN_SPARSE_ROWS)."""
    if sparse is None or q.shape[2] <= DECODE_MAX_ROWS:
        return None
    return sparse.heads(q.shape[1], offset)


def install_sparse(model, method: SparseMethod | None, head_offset: int = 0) -> None:
    """Bind `method` to every attention layer of `model` (None removes it). Layer ids are global
    (a pipeline stage's `layer_ids`), so each stage reads its own layers' patterns."""
    ids = getattr(model, "layer_ids", None) or list(range(len(model.layers)))
    for gid, block in zip(ids, model.layers):
        block.attention.sparse = None if method is None else LayerSparse(method, gid, head_offset)


def refuse_sparse(sparse: LayerSparse | None, strategy: str) -> None:
    if sparse is not None:
        raise ValueError(f"--sparse does not compose with --cp-strategy {strategy}: its patterns are estimated over "
                         "a row's whole key range, which a ring step never sees; use dense, ulysses, star or apb")
