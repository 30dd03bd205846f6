"""The interface every context strategy implements, and the sharded-KV decode they all share.

A strategy tells each CP rank which prompt tokens it runs in prefill (`segments`), how its attention
layers behave during prefill (`prefill_attend`), and whether the query part of the prompt runs
afterwards as a distributed "decode" phase (Star, APB) or inside the prefill (exact strategies).
Decode is the same for all: every CP rank runs the new token against its own KV shard, partial
results merge by log-sum-exp over the CP group, and only the query rank stores the new KV.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from starshard.engine.kv_cache import LayerKV
from starshard.engine.model import AttendFn
from starshard.kernels.attention import attention
from starshard.kernels.common import mark_end, mark_increasing, upload
from starshard.parallel.context.group_merge import merge_over_group
from starshard.parallel.context.wire import WireStats
from starshard.strategies import get_spec


@dataclass
class Segment:
    """One prefill forward pass on this rank.

    index: positions in the prompt of the tokens run, in run order (padding rows repeat a real
           token and are never cached or seen: their positions lie past the prompt).
    positions: global RoPE / mask position of each row.
    cache_rows: which rows' KV this rank keeps (None = all).
    last_row: row holding the prompt's final token when this rank owns it.
    """

    index: torch.Tensor
    positions: torch.Tensor
    cache_rows: torch.Tensor | None = None
    last_row: int = -1  # row of the latest real token (padding may follow it)

    def to(self, device) -> "Segment":
        """This segment on `device` without a device sync: non-blocking copies (common.upload), and the positions'
        layout, read here on the host, noted on the copy (their end, and whether they strictly increase:
        common.mark_end / mark_increasing), so that no attention call and not the cache's advance read it back
        from the device."""
        pos = self.positions
        rows = None if self.cache_rows is None else upload(self.cache_rows, device)
        seg = Segment(upload(self.index, device), upload(pos, device), rows, self.last_row)
        if pos.device.type == "cpu" and pos.dim() == 1 and pos.numel() > 0:
            end = int(pos.max()) + 1
            note = mark_increasing if bool((pos[1:] > pos[:-1]).all()) else mark_end
            note(seg.positions, end)
        return seg


def cache_append(cache: LayerKV | None, k, v, pos, rows: torch.Tensor | None) -> None:
    if cache is None:
        return
    if rows is not None:
        k, v, pos = k[:, :, rows], v[:, :, rows], pos[rows]
    cache.store(k, v, pos)


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


class ContextStrategy:
    """Base: holds the CP group; subclasses define segments and prefill attention."""

    name = "base"
    query_phase = False  # True: the query tokens run after the prefill, like decode steps
    # --fp8 attention: its prefill's square causal calls take 8-bit scores (kernels/attention.py
    # causal_attention_int8_scores); set by the runner's builder where the strategy has such calls.
    int8_scores = False

    def __init__(self, group=None, query_rank: int | None = None):
        self.group = group
        self.cp = group_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.query_rank = self.cp - 1 if query_rank is None else query_rank
        if not 0 <= self.query_rank < self.cp:
            raise ValueError(f"query rank {self.query_rank} is outside the CP group of size {self.cp}")
        self.wire = WireStats()  # K/V bytes this rank's prefill sent to its peers (wire.py)

    @classmethod
    def from_options(cls, group, options: dict, *, cp_groups=None, tp_group=None) -> "ContextStrategy":
        """make_strategy's builder: the strategy over `group` from its checked options (field -> value,
        unset ones absent); a strategy with options of its own overrides it."""
        return cls(group, options.get("query_rank"))

    @property
    def is_query_rank(self) -> bool:
        return self.rank == self.query_rank

    def spec_options(self) -> dict:
        """Its options as the registry's StrategySpec reads them (field -> value)."""
        return {"query_rank": self.query_rank}

    def rank_rows(self, prompt_len: int, context_len: int, chunk: int | None = None,
                  knee: int | None = None) -> list[int]:
        """KV rows each CP rank keeps for this prompt's prefill (StrategySpec.rank_rows), run whole or
        `chunk` tokens a step (tapered after `knee`): pure arithmetic, the same on every rank, no collective."""
        return get_spec(self.name).rank_rows(self.cp, prompt_len, context_len, self.spec_options(), chunk, knee)

    def prefill_bounds(self, prompt_len: int, context_len: int, chunk: int | None,
                       knee: int | None = None) -> list[tuple[int, int]]:
        """The prompt positions [start, end) of each prefill step (StrategySpec.prefill_bounds)."""
        return get_spec(self.name).prefill_bounds(self.cp, prompt_len, context_len, self.spec_options(), chunk, knee)

    def chunk_hidden(self, start: int, end: int, context_len: int) -> tuple[int, int] | None:
        """Key positions [lo, hi) that a later prefill step of context [start, end) must not see although
        they precede it (parallel/context/chunked.py); None: it sees every earlier key (exact)."""
        return None

    # -- optional hooks: the runner calls each on every strategy; the defaults do nothing
    def check_heads(self, heads: int, kv_heads: int) -> None:
        """Refuse (ValueError) a head count this strategy cannot split; called on every rank before
        any collective, with this rank's (tensor-parallel) head counts."""

    def bind(self, model) -> None:
        """Called once with the rank's model (APB reads its RoPE and layer ids)."""

    def use_prompt_head(self, head_len: int) -> None:
        """Called before each prefill with the chat template head's length in tokens (APB places
        the embedded query after it)."""

    @classmethod
    def shard_positions(cls, prompt_len: int, cp: int, rank: int, options: dict) -> torch.Tensor | None:
        """The positions (padding included) CP rank `rank` of `cp` holds after this strategy's own prefill of
        a prompt_len-token prompt, where they follow from these alone (an exact strategy's sequence layout:
        serving/kv_layout.py rebuilds a rank's shard from another layout's files by it); None: no such layout."""
        return None

    # -- required
    def segments(self, prompt_len: int, context_len: int) -> list[Segment]:
        raise NotImplementedError

    def prefill_attend(self, segment: Segment) -> AttendFn:
        raise NotImplementedError

    def last_token_rank(self, prompt_len: int, context_len: int) -> int:
        """CP rank whose last prefill segment holds the prompt's final token (at `last_row`)."""
        return self.query_rank

    def decode_attend(self, q, k, v, pos, cache: LayerKV | None, sparse=None, window=None, softcap=None, scale=None):
        """Sharded-KV attention for new tokens: local partial + lse merge over the CP group (dense:
        a sparse method covers prefill only). window / softcap / scale: the layer's (AttendFn); a rank
        whose keys all lie outside a local layer's window contributes an empty partial (lse = -inf)."""
        if cache is None:
            raise ValueError("decode needs a KV cache")
        if self.is_query_rank:
            cache.store(k, v, pos)
        s = cache.stored()  # as stored: an FP8 shard is read in e4m3 by the decode kernel
        # A single new token follows every key of every shard: no mask needed, unless a window hides the oldest.
        out, lse = attention(q, s.k, s.v, q_pos=pos, k_pos=s.pos, causal=q.shape[2] > 1 or window is not None,
                             k_scale=s.k_scale, v_scale=s.v_scale, window=window, softcap=softcap, scale=scale)
        if self.cp > 1:
            out, lse = merge_over_group(out, lse, self.group)
        return out
