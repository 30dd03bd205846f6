"""Partition rules that need only the model config: which heads and rows a tensor-parallel rank holds,
how layers split into pipeline stages, a prefill's steps (tapered after a knee), how Star cuts the
context into blocks, APB's default anchor / passing sizes, and the real rows of each CP rank's
sequence shard (zigzag, contiguous, USP).

Pure arithmetic, no torch and nothing above config: the memory planner and the runtime both read
these, so the plan never re-implements a rule the runtime follows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from starshard.config import ModelConfig


# ---------------------------------------------------------------------------- tensor parallel
def valid_tp_sizes(cfg: ModelConfig, limit: int = 64) -> list[int]:
    out = []
    for t in range(1, limit + 1):
        kv_ok = cfg.num_kv_heads % t == 0 or t % cfg.num_kv_heads == 0
        dense_ok = not cfg.has_dense_layers or cfg.intermediate_size % t == 0
        experts_ok = not cfg.num_experts or cfg.moe_intermediate_size % t == 0
        if cfg.num_heads % t == 0 and kv_ok and dense_ok and experts_ok:
            out.append(t)
    return out


def check_tp(cfg: ModelConfig, tp: int) -> None:
    if tp < 1 or tp not in valid_tp_sizes(cfg, max(tp, 1)):
        raise ValueError(
            f"tp={tp} does not divide this model ({cfg.num_heads} heads, {cfg.num_kv_heads} KV heads, "
            f"intermediate {cfg.intermediate_size}"
            + (f", expert intermediate {cfg.moe_intermediate_size}" if cfg.num_experts else "")
            + f"); valid tp sizes: {valid_tp_sizes(cfg)}"
        )


@dataclass(frozen=True)
class TPShard:
    """Which heads / rows one tensor-parallel rank holds."""

    cfg: ModelConfig
    tp: int
    rank: int

    def __post_init__(self):
        check_tp(self.cfg, self.tp)

    @property
    def heads(self) -> int:
        return self.cfg.num_heads // self.tp

    @property
    def kv_heads(self) -> int:
        return max(1, self.cfg.num_kv_heads // self.tp)

    @property
    def kv_head_start(self) -> int:
        # With fewer KV heads than ranks, each KV head is replicated on tp / Hkv neighbouring ranks.
        if self.cfg.num_kv_heads >= self.tp:
            return self.rank * self.kv_heads
        return self.rank // (self.tp // self.cfg.num_kv_heads)

    @property
    def padded_vocab(self) -> int:
        return -(-self.cfg.vocab_size // self.tp) * self.tp

    @property
    def vocab_slice(self) -> slice:
        n = self.padded_vocab // self.tp
        return slice(self.rank * n, (self.rank + 1) * n)

    @property
    def ffn_slice(self) -> slice:
        n = self.cfg.intermediate_size // self.tp
        return slice(self.rank * n, (self.rank + 1) * n)

    @property
    def expert_slice(self) -> slice:
        """This rank's columns of every expert's width (MoE layers: each expert split like the dense MLP;
        every rank holds all experts and the router)."""
        n = self.cfg.moe_intermediate_size // self.tp
        return slice(self.rank * n, (self.rank + 1) * n)


# ---------------------------------------------------------------------------- pipeline stages
def partition_layers(num_layers: int, pp: int, pp_layers: list[int] | None = None) -> list[list[int]]:
    """Global layer indices per stage: `pp_layers` counts if given, else an even split (earlier
    stages take the remainder, since the last stage also runs the LM head)."""
    if pp < 1:
        raise ValueError(f"pp must be >= 1, got {pp}")
    if pp > num_layers:
        raise ValueError(f"pp={pp} exceeds the model's {num_layers} layers; use pp <= {num_layers}")
    if pp_layers is None:
        base, extra = divmod(num_layers, pp)
        pp_layers = [base + (1 if s < extra else 0) for s in range(pp)]
    pp_layers = list(pp_layers)
    if len(pp_layers) != pp or sum(pp_layers) != num_layers or min(pp_layers) < 1:
        raise ValueError(
            f"--pp-layers {pp_layers} must give {pp} positive counts summing to the model's {num_layers} layers"
        )
    stages, start = [], 0
    for n in pp_layers:
        stages.append(list(range(start, start + n)))
        start += n
    return stages


# ---------------------------------------------------------------------------- Star Attention
def star_sizes(context_len: int, cp: int, block_size: int | None = None, anchor_size: int | None = None,
               num_blocks: int | None = None) -> tuple[int, int]:
    """(block, anchor): block defaults to ceil(context / num_blocks), num_blocks to cp (so cp=1 with
    num_blocks=N runs exactly what N hosts would, one block after another); anchor defaults to the
    block size."""
    block = block_size or max(1, math.ceil(context_len / (num_blocks or cp)))
    return block, anchor_size or block


def star_blocks(context_len: int, block_size: int, cp: int) -> list[list[tuple[int, int]]]:
    """Context blocks [start, end) per CP rank: contiguous runs of blocks, as even as possible."""
    n = math.ceil(context_len / block_size)
    bounds = [(i * block_size, min(context_len, (i + 1) * block_size)) for i in range(n)]
    per_rank: list[list[tuple[int, int]]] = [[] for _ in range(cp)]
    for i, b in enumerate(bounds):
        per_rank[i * cp // n].append(b)
    return per_rank


# ---------------------------------------------------------------------------- prefill steps
TAPER_ROWS_PER_RANK = 256


def taper_align(chunk: int, cp: int = 1) -> int:
    """The unit of a tapered schedule's steps: 256 rows per CP rank (a rank's two zigzag halves stay whole
    128-row query tiles of the attention kernels, and the smallest step still dwarfs a step's fixed costs:
    launches, the CP collectives, the decode step between), at most chunk / 8 (a small chunk still tapers),
    a multiple of 2 x cp (the zigzag's halves: no padding rows)."""
    unit = 2 * cp
    return max(unit, min(TAPER_ROWS_PER_RANK * cp, chunk // 8 // unit * unit))


def prefill_steps(end: int, chunk: int | None, knee: int | None = None, cp: int = 1, start: int = 0,
                  held: int = 0) -> list[tuple[int, int]]:
    """[s, e) of each prefill step over prompt positions [start, end), `held` tokens visible before `start`.

    `chunk` tokens a step (None or 0: one step). With `knee` K (strategies/flops.py prefill_knee; None: no
    taper) later steps shrink: per CP rank a step of r rows after h visible tokens costs about
    r * (1 + (h + r/2) / K) token-linears (its linear layers, plus attention over the held keys), so a step
    at h = held + s - start takes rows(h) = min(chunk, chunk * 2K / (K + h)) floored to taper_align(chunk,
    cp), never fewer: no step costs more than a chunk-token step after K held tokens, about twice the first.
    The one schedule every layout derives from the chunk (runners, StrategySpec.prefill_bounds / rank_rows,
    the service); pure arithmetic."""
    if chunk is not None and chunk < 0:
        raise ValueError(f"--prefill-chunk must be >= 0 tokens (0: the whole prompt), got {chunk}")
    if knee is not None and knee < 1:
        raise ValueError(f"the prefill taper's knee must be >= 1 token, got {knee}")
    if not chunk:
        return [(start, end)] if end > start else []
    if knee is None:
        return [(s, min(s + chunk, end)) for s in range(start, end, chunk)]
    align = taper_align(chunk, cp)
    steps, s = [], start
    while s < end:
        rows = chunk * 2 * knee // (knee + held + s - start)
        rows = chunk if rows >= chunk else min(chunk, max(align, rows // align * align))
        steps.append((s, min(s + rows, end)))
        s += rows
    return steps


# ---------------------------------------------------------------------------- APB
APB_SIZE_CAP = 8192  # the paper's largest anchor / passing sizes (Table 5)


def apb_default_sizes(block: int) -> tuple[int, int]:
    """(anchor, passing) for a per-host block of `block` context tokens (paper Table 5, scaled down)."""
    anchor = min(APB_SIZE_CAP, max(block // 4, min(block, 64)))
    passing = min(APB_SIZE_CAP, max(block // 8, min(block, 32)))
    return anchor, passing


def apb_bounds(context_len: int, hosts: int) -> list[int]:
    """Block boundaries: host h holds context [bounds[h], bounds[h+1]) (sizes differ by at most one)."""
    return [context_len * r // hosts for r in range(hosts + 1)]


# ---------------------------------------------------------------------------- sequence shards
def _real(n: int, start: int, length: int) -> int:
    """Real tokens (positions < n) among positions [start, start + length)."""
    return max(0, min(n, start + length) - start)


def zigzag_rows(n: int, cp: int, rank: int) -> int:
    """Real rows of rank's zigzag shard of an n-token sequence: chunks rank and 2cp-1-rank of
    ceil(n / 2cp) positions (padding past n is never stored)."""
    c = -(-n // (2 * cp))
    return _real(n, rank * c, c) + _real(n, (2 * cp - 1 - rank) * c, c)


def contiguous_rows(n: int, cp: int, rank: int) -> int:
    """Real rows of rank's contiguous shard [rank * ceil(n/cp), +ceil(n/cp)) (Ulysses)."""
    return _real(n, rank * -(-n // cp), -(-n // cp))


def usp_rows(n: int, ring_degree: int, ulysses_degree: int, ring_rank: int, ulysses_rank: int) -> int:
    """Real rows of a USP shard: the zigzag over the ring of n padded to a multiple of
    2 x ring x ulysses, then the ring rank's two chunks, in order, split contiguously over its
    Ulysses group (parallel/context/sharding.py usp_positions)."""
    unit = 2 * ring_degree * ulysses_degree
    c = -(-n // unit) * unit // (2 * ring_degree)  # one zigzag chunk of the padded sequence
    piece = 2 * c // ulysses_degree
    lo, hi = ulysses_rank * piece, (ulysses_rank + 1) * piece  # this Ulysses rank's slice of the 2c rows
    rows = 0
    for first, chunk in ((0, ring_rank), (c, 2 * ring_degree - 1 - ring_rank)):
        a, b = max(lo, first), min(hi, first + c)
        if b > a:
            rows += _real(n, chunk * c + a - first, b - a)
    return rows
