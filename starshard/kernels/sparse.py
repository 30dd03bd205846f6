"""Sparse prefill methods bound to a model's layers: what `--sparse` switches on.

A sparse method covers a whole model (MInference's per-layer, per-head patterns; AnchorAttention's
threshold). Each attention layer holds a `LayerSparse`: the method, the layer's id and the first
query head this rank holds under tensor parallelism. A context strategy asks it for the pattern of
the heads it is about to attend (Ulysses: a slice of the local heads) and passes that pattern to
`attention(..., sparse=pattern)`, which calls `pattern.attention(...)`. Decode steps stay dense.

Strategies that split a row's keys over ranks (ring, USP) refuse a sparse method: the patterns are
estimated from the whole key range of a row, which no ring step sees.

Never slower than dense (`load_sparse_method` wraps the method in `FallbackSparse`): a call with
fewer keys than `SparseConfig.min_length` runs the dense kernel without estimating anything (the
measured crossover, `MIN_LENGTH`); a longer one estimates its pattern, and every head whose sparse
kernel would not beat the dense kernel by the rates measured for its head dim
(minference.measured_rates, anchor.measured_anchor_rates) runs the dense kernel, so its (out, lse) are
exactly dense attention's. AnchorAttention also has a per-call floor: a call whose heads keep on average
at least the break-even density (`SparseConfig.fallback_density`, default the stripe kernel's measured
rate, anchor.MEASURED_ANCHOR_RATES) runs the dense kernel whole, exactly, counted per layer
(`SparseReport.calls_fallen_back`).
`SparseReport` (the method's `report`, `sparse_report(model)`) counts what ran.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import torch

from starshard.kernels.anchor import AnchorConfig, measured_anchor_rates
from starshard.kernels.anchor_model import AnchorModelConfig
from starshard.kernels.attention import attention
from starshard.kernels.common import DECODE_MAX_ROWS, MIN_SPARSE_ROWS
from starshard.kernels.minference import MInferenceConfig, measured_rates
from starshard.strategies import sparse_error

SPARSE_METHODS = ("minference", "anchor")

# The fewest keys (k.shape[2] of the attention call) at which a call estimates a pattern on CUDA:
# more than 64K. Below it the dense kernel runs, nothing estimated. Measured on one H200 (bf16):
# - sparse starts to pay above 64K: MInference Vertical-Slash (1000, 6096), index included, 0.48x
#   cuDNN dense at 32K, 0.98x / 1.06x at 64K, 2.0x at 128K (32 x d128, structured inputs;
#   docs/results.md, Sparse prefill); on the 8B shape at 64K
#   the call with the fallback ties dense on structured inputs (57.7 vs 57.7 ms) and loses 13% on
#   random ones (66.0 vs 58.2 ms: the estimate, then dense); at 128K it takes 0.57x / 1.07x of the
#   dense time (docs/results.md, Sparse prefill);
# - AnchorAttention's identification, spent before it can tell dense-like stripes, is 2.7 / 5.5 /
#   14 ms per layer at 32K / 64K / 128K against 13 / 57 / 239 ms of dense attention
#   (docs/results.md, Sparse prefill): about 6 / 5 / 4% of an 8B prefill when the stripes then
#   turn out dense; kept at the same bound (its wins at 32K need min_length 0).
# Other devices: nothing measured, default 0 (CPU runs are tests and accuracy studies).
MIN_LENGTH = 65536 + 1


class SparseMethod(Protocol):
    def pattern(self, layer: int, num_heads: int, head_offset: int = 0):
        """The `sparse=` spec for `num_heads` query heads starting at global head `head_offset`."""


@dataclass(frozen=True)
class SparseConfig:
    """--sparse METHOD [--sparse-config FILE] [--anchor-theta T --anchor-block-q N --anchor-step S].

    minference: per-head patterns from FILE (default Vertical-Slash 1000/6096 everywhere).
    anchor: AnchorAttention with per-head thresholds and the pooling from FILE (calibrated per model
    by `starshard.tools.anchor_calibrate`), or without FILE one threshold for every head (anchor_theta,
    anchor_block_q, anchor_step; None: the paper's theta 12, 128-row blocks pooled, one stripe selection
    per 16 blocks, ANCHOR_DEFAULTS; small models at a few K tokens need finer pooling). LLM gives a model
    that ships its calibration (checkpoints/named.py) that file when none of the four is set.

    min_length: calls over fewer keys run dense, nothing estimated (None: MIN_LENGTH, i.e. more than
    64K keys, on CUDA, 0 elsewhere; 0 estimates at every length). fallback: after the estimate,
    heads whose sparse kernel would not beat the dense kernel run dense (None: on CUDA only, where
    the rates were measured; True: everywhere, with the measured rates; False: never, every head runs
    its pattern). fallback_density (anchor only): the per-call floor, the mean head density at or above
    which a call runs dense whole (None: the break-even density, the stripe kernel's measured rate for
    the head dim, anchor.MEASURED_ANCHOR_RATES). fallback_sample (anchor only): query-block groups
    identified first to check that floor before the full identification (None: 4,
    anchor.FLOOR_SAMPLE_GROUPS; 0: the floor is checked after the full identification only). Either one
    set turns the fallback on on every device (not only CUDA)."""

    method: str
    config_path: str | None = None
    anchor_theta: float | None = None
    anchor_block_q: int | None = None
    anchor_step: int | None = None
    min_length: int | None = None
    fallback: bool | None = None
    fallback_density: float | None = None
    fallback_sample: int | None = None

    def __post_init__(self):
        if self.min_length is not None and (type(self.min_length) is not int or self.min_length < 0):
            raise ValueError(f"sparse min_length must be a whole number of keys >= 0 (0: always estimate), "
                             f"got {self.min_length!r}")
        if self.method not in SPARSE_METHODS:
            raise ValueError(f"unknown --sparse {self.method!r}; choose one of {', '.join(SPARSE_METHODS)}")
        floor = self.fallback_density is not None or self.fallback_sample is not None
        if floor and self.method != "anchor":
            raise ValueError("--sparse-fallback-density / --sparse-fallback-sample set AnchorAttention's per-call "
                             "floor; MInference prices each head alone: drop them or use --sparse anchor")
        if floor and self.fallback is False:
            raise ValueError("--sparse-no-fallback turns the fallback off: drop --sparse-fallback-density / "
                             "--sparse-fallback-sample, or drop --sparse-no-fallback")
        if self.fallback_density is not None and not (
                type(self.fallback_density) in (int, float) and 0 < self.fallback_density):
            raise ValueError(f"sparse fallback_density must be a share of the causal pairs > 0 (above 1: no "
                             f"per-call floor), got {self.fallback_density!r}")
        if self.fallback_sample is not None and (type(self.fallback_sample) is not int or self.fallback_sample < 0):
            raise ValueError(f"sparse fallback_sample must be a whole number of query-block groups >= 0, "
                             f"got {self.fallback_sample!r}")
        if self.method != "anchor" and self.anchor_flags:
            raise ValueError(f"--anchor-theta / --anchor-block-q / --anchor-step set AnchorAttention's thresholds; "
                             f"--sparse {self.method} has none: drop them or use --sparse anchor")
        if self.method == "anchor" and self.config_path is not None and self.anchor_flags:
            raise ValueError("--sparse-config fixes AnchorAttention's thresholds and pooling: drop --anchor-theta / "
                             "--anchor-block-q / --anchor-step, or drop --sparse-config")
        if self.config_path is not None and not Path(self.config_path).is_file():
            tool = "anchor_calibrate" if self.method == "anchor" else "minference_search"
            raise ValueError(f"--sparse-config {self.config_path} does not exist; write one with "
                             f"`python -m starshard.tools.{tool} --out FILE` or drop the flag")

    @property
    def anchor_flags(self) -> bool:
        """One of --anchor-theta / --anchor-block-q / --anchor-step was given (a model's shipped calibration,
        which fixes all three, then stays out)."""
        return any(x is not None for x in (self.anchor_theta, self.anchor_block_q, self.anchor_step))

    def uniform_anchor(self) -> AnchorConfig:
        """One threshold for every head: the flags given, the paper's values (ANCHOR_DEFAULTS) for the rest."""
        d = ANCHOR_DEFAULTS
        return AnchorConfig(theta=d.theta if self.anchor_theta is None else self.anchor_theta,
                            block_q=d.block_q if self.anchor_block_q is None else self.anchor_block_q,
                            step=d.step if self.anchor_step is None else self.anchor_step)


ANCHOR_DEFAULTS = AnchorConfig()  # the paper's theta 12, 128-row blocks, step 16


@dataclass(frozen=True)
class UniformSparse:
    """One spec for every layer and head (AnchorAttention selects per head at run time)."""

    spec: object

    def pattern(self, layer: int, num_heads: int, head_offset: int = 0):
        return self.spec


@dataclass
class SparseReport:
    """What an installed method ran since its last reset, per (attention call, query head):
    heads_sparse ran the sparse kernel, keeping `mean_density` of the causal work on average
    (MInference: score entries its kernel computes / a dense causal kernel's; AnchorAttention: kept
    (row, key) pairs / causal pairs); heads_dense were estimated and then sent to the dense kernel by
    the cost model (or are Dense in the config); heads_skipped belong to calls shorter than
    min_length (dense, nothing estimated); calls_fallen_back were estimated and then run dense whole by
    AnchorAttention's per-call floor (their heads count in heads_dense), per layer in
    fallen_back_by_layer. Decode steps are not counted (they never reach the method)."""

    calls: int = 0
    heads_sparse: int = 0
    heads_dense: int = 0
    heads_skipped: int = 0
    kept: float = 0.0  # sum of the sparse heads' densities (a 0-dim CUDA tensor once one was)
    calls_fallen_back: int = 0
    fallen_back_by_layer: dict = field(default_factory=dict)

    def record(self, sparse_densities, dense_heads: int) -> None:
        """One estimated call: the densities of its sparse heads, how many heads ran dense."""
        self.calls += 1
        self.heads_sparse += len(sparse_densities)
        # a device tensor (of the densities, or their sum) is read in as_dict, not here: no sync per call
        kept = sparse_densities.sum() if isinstance(sparse_densities, torch.Tensor) else sum(sparse_densities)
        self.kept = self.kept + kept
        self.heads_dense += int(dense_heads)

    def skip(self, heads: int) -> None:
        self.calls += 1
        self.heads_skipped += int(heads)

    def fall_back(self, heads: int, layer: int | None = None) -> None:
        """One estimated call run dense whole by the per-call floor."""
        self.record([], heads)
        self.calls_fallen_back += 1
        self.fallen_back_by_layer[layer] = self.fallen_back_by_layer.get(layer, 0) + 1

    def reset(self) -> None:
        self.calls = self.heads_sparse = self.heads_dense = self.heads_skipped = self.calls_fallen_back = 0
        self.kept = 0.0
        self.fallen_back_by_layer = {}

    def as_dict(self) -> dict:
        by_layer = sorted(self.fallen_back_by_layer.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))
        return {"calls": self.calls, "heads_sparse": self.heads_sparse, "heads_dense": self.heads_dense,
                "heads_skipped": self.heads_skipped,
                "mean_density": float(self.kept) / self.heads_sparse if self.heads_sparse else None,
                "calls_fallen_back": self.calls_fallen_back,
                "fallen_back_by_layer": {str(k): n for k, n in by_layer}}  # JSON keys: layer ids as text


@dataclass(frozen=True)
class LayerReport:
    """A SparseReport as one layer's call sees it: fall_back counts under the layer."""

    report: SparseReport
    layer: int | None

    def record(self, sparse_densities, dense_heads: int) -> None:
        self.report.record(sparse_densities, dense_heads)

    def fall_back(self, heads: int) -> None:
        self.report.fall_back(heads, self.layer)


class FallbackSparse:
    """A sparse method as installed: its patterns, guarded so that it is never slower than dense (the
    module docstring), and its `report`."""

    def __init__(self, method: SparseMethod, cfg: SparseConfig):
        self.method = method
        self.config = cfg
        self.report = SparseReport()

    def pattern(self, layer: int, num_heads: int, head_offset: int = 0):
        return GuardedPattern(self.method.pattern(layer, num_heads, head_offset), self, layer)

    def min_length(self, device: torch.device) -> int:
        if self.config.min_length is not None:
            return self.config.min_length
        return MIN_LENGTH if device.type == "cuda" else 0

    def rates(self, device: torch.device, head_dim: int):
        floor = self.config.fallback_density is not None or self.config.fallback_sample is not None
        on = self.config.fallback if self.config.fallback is not None else (device.type == "cuda" or floor)
        if not on:
            return None
        if self.config.method != "anchor":
            return measured_rates(head_dim)
        rates = measured_anchor_rates(head_dim)
        if not floor:
            return rates
        sample = rates.sample_groups if self.config.fallback_sample is None else self.config.fallback_sample
        return replace(rates, call_density=self.config.fallback_density, sample_groups=sample)


@dataclass(frozen=True)
class GuardedPattern:
    """One call's `sparse=` spec under FallbackSparse: below min_length the dense dispatcher, else the
    method's spec with the cost model and the report."""

    spec: object
    owner: FallbackSparse
    layer: int | None = None

    def attention(self, q, k, v, *, q_pos, k_pos, causal=True, scale=None):
        own = self.owner
        if causal and q.shape[2] >= MIN_SPARSE_ROWS and k.shape[2] < own.min_length(q.device):
            own.report.skip(q.shape[1])
            return attention(q, k, v, q_pos=q_pos, k_pos=k_pos, causal=causal, scale=scale)
        return self.spec.attention(q, k, v, q_pos=q_pos, k_pos=k_pos, causal=causal, scale=scale,
                                   rates=own.rates(q.device, q.shape[-1]),
                                   report=LayerReport(own.report, self.layer))


def load_sparse_method(cfg: SparseConfig) -> FallbackSparse:
    if cfg.method == "anchor" and cfg.config_path:  # calibrated: thetas per layer and head
        method = AnchorModelConfig.load(cfg.config_path)
    elif cfg.method == "anchor":
        method = UniformSparse(cfg.uniform_anchor())
    else:  # no file: every head uses the default Vertical-Slash (1000 columns, 6096 diagonals)
        method = MInferenceConfig.load(cfg.config_path) if cfg.config_path else MInferenceConfig()
    return FallbackSparse(method, cfg)


def sparse_report(model, reset: bool = False) -> dict | None:
    """The installed method's SparseReport as a dict (None without one, or for a method installed
    without `load_sparse_method`); reset=True zeroes it afterwards."""
    for block in getattr(model, "layers", []):
        sp = getattr(block.attention, "sparse", None)
        rep = getattr(getattr(sp, "method", None), "report", None)
        if isinstance(rep, SparseReport):
            out = rep.as_dict()
            if reset:
                rep.reset()
            return out
    return None


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
    """Bind `method` to every global attention layer of `model` (None removes it). Layer ids are global
    (a pipeline stage's `layer_ids`), so each stage reads its own layers' patterns. A local layer (a
    sliding window) keeps dense attention: its window already bounds its keys, and the kernels' patterns
    take no window."""
    ids = getattr(model, "layer_ids", None) or list(range(len(model.layers)))
    for gid, block in zip(ids, model.layers):
        local = "window" in getattr(block.attention, "extras", {})
        block.attention.sparse = None if method is None or local else LayerSparse(method, gid, head_offset)


def refuse_sparse(sparse: LayerSparse | None, strategy: str) -> None:
    """Inside a strategy's attention: refuse a sparse pattern where the registry says it does not compose."""
    bad = sparse_error(strategy) if sparse is not None else None
    if bad:
        raise ValueError(bad)
