"""Which global positions each CP rank holds (sequence sharding for ring, ulysses and usp).

Every helper pads the sequence so that all ranks hold the same number of rows (the collectives need
equal shard shapes). Padding rows get positions >= seq_len, after every real token: under causal
attention by position no real query ever sees them, so results for real tokens stay exact and no
real token is ever dropped. Padding rows produce meaningless outputs; callers drop them (`valid`)
and must never cache their KV.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SeqShard:
    """This rank's rows: `positions` [n] (padding included, >= seq_len) of a `seq_len`-token sequence."""

    positions: torch.Tensor
    seq_len: int

    @property
    def valid(self) -> torch.Tensor:
        """Bool [n]: True for real tokens, False for padding rows."""
        return self.positions < self.seq_len

    @property
    def num_valid(self) -> int:
        return int(self.valid.sum())

    @property
    def rows(self) -> torch.Tensor:
        """Row indices of the real tokens (use them to drop padding from outputs / KV)."""
        return self.valid.nonzero().squeeze(1)

    @property
    def token_index(self) -> torch.Tensor:
        """Index into the sequence's tokens for each row; padding rows repeat token 0."""
        return torch.where(self.valid, self.positions, torch.zeros_like(self.positions))


def _check(seq_len: int, parts: int, rank: int, what: str = "cp") -> None:
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if parts < 1:
        raise ValueError(f"{what} must be >= 1, got {parts}")
    if not 0 <= rank < parts:
        raise ValueError(f"rank {rank} is outside 0..{parts - 1} ({what}={parts})")


def zigzag_chunks(seq_len: int, cp: int) -> tuple[int, int]:
    """(chunk size, padded length): the sequence padded up to a multiple of 2*cp."""
    chunk = math.ceil(seq_len / (2 * cp))
    return chunk, chunk * 2 * cp


def zigzag_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions rank holds: chunks `rank` and 2cp-1-rank of the padded sequence.

    Pairing an early chunk with a late one gives every rank the same causal work. Positions
    >= seq_len are padding (see `zigzag_shard`).
    """
    _check(seq_len, cp, rank)
    c, _ = zigzag_chunks(seq_len, cp)
    first, second = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat([torch.arange(first, first + c), torch.arange(second, second + c)])


def zigzag_shard(seq_len: int, cp: int, rank: int) -> SeqShard:
    return SeqShard(zigzag_positions(seq_len, cp, rank), seq_len)


def contiguous_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Positions [rank*n, (rank+1)*n) with n = ceil(seq_len/cp): an even split (Ulysses); the
    remainder is padding at the end, so trailing ranks may hold padding (or only padding)."""
    _check(seq_len, cp, rank)
    n = math.ceil(seq_len / cp)
    return torch.arange(rank * n, (rank + 1) * n)


def contiguous_shard(seq_len: int, cp: int, rank: int) -> SeqShard:
    return SeqShard(contiguous_positions(seq_len, cp, rank), seq_len)


def usp_positions(seq_len: int, ring_degree: int, ulysses_degree: int, ring_rank: int, ulysses_rank: int) -> torch.Tensor:
    """USP layout: zigzag over the ring (balanced causal work), then each ring rank's two chunks,
    taken in order, split contiguously over its Ulysses group. After the Ulysses all-to-all a ring
    rank therefore sees its zigzag shard as two contiguous runs (the ring's fast unmasked steps)."""
    _check(seq_len, ring_degree, ring_rank, "ring_degree")
    _check(seq_len, ulysses_degree, ulysses_rank, "ulysses_degree")
    unit = 2 * ring_degree * ulysses_degree
    padded = math.ceil(seq_len / unit) * unit
    ring_pos = zigzag_positions(padded, ring_degree, ring_rank)  # no padding inside: padded fits
    n = ring_pos.numel() // ulysses_degree
    return ring_pos[ulysses_rank * n : (ulysses_rank + 1) * n].clone()


def usp_shard(seq_len: int, ring_degree: int, ulysses_degree: int, ring_rank: int, ulysses_rank: int) -> SeqShard:
    return SeqShard(usp_positions(seq_len, ring_degree, ulysses_degree, ring_rank, ulysses_rank), seq_len)
