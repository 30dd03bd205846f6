"""What one context strategy declares, pure (no torch): its options and their flags, its refusals,
the KV rows a rank keeps, its FLOP model and what it composes with. One module per strategy
subclasses StrategySpec; strategies/__init__.py registers them; the torch classes live in
parallel/context/ under the same names.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

from starshard.config import ModelConfig
from starshard.partition import prefill_steps, zigzag_rows
from starshard.strategies.flops import PrefillFlops


@dataclass(frozen=True)
class Option:
    """One strategy option: the ParallelConfig field (= make_strategy keyword = argparse dest) and its flag."""

    field: str
    flag: str
    help: str
    type: Callable | None = int
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    const: Any = None  # a store_const flag: given = this value (--no-embed-query stores False)
    exclusive: bool = False  # refused with any strategy that does not declare it (else it is ignored there)

    def argparse_kwargs(self) -> dict:
        """add_argument's keywords (default None: unset = the strategy's default)."""
        if self.const is not None:
            return dict(dest=self.field, action="store_const", const=self.const, default=None, help=self.help)
        kw = dict(dest=self.field, type=self.type, default=None, help=self.help)
        if self.choices is not None:
            kw["choices"] = list(self.choices)
        if self.metavar is not None:
            kw["metavar"] = self.metavar
        return kw


# Options more than one strategy reads (each strategy's own sit in its module).
QUERY_RANK = Option("query_rank", "--query-rank",
                    "CP rank that owns the query and the generated tokens' KV (default: the last)")
ANCHOR_SIZE = Option("anchor_size", "--anchor-size",
                     "star: anchor tokens (the context's first tokens) before each block (default: block size); "
                     "apb: anchor tokens per host (default: the paper's table, context/hosts/4 capped at 8192; 0 = none)")
NUM_BLOCKS = Option("num_blocks", "--num-blocks",
                    "star: cut the context into this many blocks instead of giving --block-size (default: --cp); "
                    "with --cp 1 this runs on one device exactly what that many hosts would; apb: the same as --apb-hosts")


def query_rank(cp: int, options: dict) -> int:
    """The CP rank that owns the query and the generated tokens' KV (--query-rank, default the last)."""
    q = options.get("query_rank")
    return cp - 1 if q is None else q


def query_context(prompt_len: int, context_len: int) -> int:
    """The context a query-phase strategy (Star, APB) runs: the runner borrows the prompt's last
    token as the query when the prompt is all context."""
    return min(context_len, prompt_len - 1)


def at_least(options: dict, floor: int, *fields: Option) -> None:
    """ValueError naming the flag of the first option in `fields` that is given and below `floor`."""
    for o in fields:
        v = options.get(o.field)
        if v is not None and v < floor:
            raise ValueError(f"{o.flag} must be >= {floor}, got {v}")


class StrategySpec:
    """A context strategy's pure part. Subclasses set the attributes and override what differs."""

    name = "base"
    options: tuple[Option, ...] = ()  # what it reads besides --query-rank (every strategy reads that)
    flag_group: str | None = None  # help-group title of its exclusive options
    exact = True  # output equals dense attention's
    single_rank = False  # runs on one CP rank only (dense)
    sparse = True  # composes with --sparse (a row's whole key range is seen by one attention call)
    windows = False  # runs local (sliding-window) layers exactly, and logit soft-caps and query_pre_attn_scalar
    fp8_attention: str | None = None  # where --fp8 attention's 8-bit scores run in it, e.g. "in Ulysses"
    context_cache = True  # a cached context's KV serves another question (APB's depends on the question)
    chunked_prefill = False  # the prompt runs in chunks after held KV (--prefill-chunk, pp > 1 stages)
    chunk_plan: str | None = None  # the strategy whose memory plan a chunk-long prompt follows (None: its own)
    ring_kv = False  # passes K/V blocks around the CP ring, local layers' tagged (WireStats.local_kv_bytes)
    # A context strategy's later chunks (start > 0) run one generic path (parallel/context/chunked.py):
    # the chunk's rows zigzagged over the CP ranks, its queries gathered against every rank's stored keys.

    def validate(self, cp: int, options: dict) -> None:
        """Refuse (ValueError naming the fix) option values it cannot run on `cp` ranks; `options`:
        field -> value of the options given (None dropped)."""

    def check_heads(self, heads: int, kv_heads: int, cp: int, options: dict) -> None:
        """Refuse (ValueError) head counts (per tensor-parallel rank) it cannot split over `cp` ranks."""

    def kv_rows(self, lay, w) -> tuple[int, int, int]:
        """Planner (planner.Layout `lay`, Workload `w`): (KV tokens kept, rows of the largest prefill
        forward, transient KV tokens in flight) on the worst CP rank."""
        raise NotImplementedError

    def prefill_bounds(self, cp: int, prompt_len: int, context_len: int, options: dict,
                       chunk: int | None, knee: int | None = None) -> list[tuple[int, int]]:
        """The prompt positions [start, end) of each prefill step: `chunk` tokens each, counted over the
        whole prompt (None or 0: the whole prompt in one step), later steps tapered after `knee` held
        tokens (partition.prefill_steps; None: uniform). The runner and rank_rows follow it."""
        if chunk is not None and chunk < 0:
            raise ValueError(f"--prefill-chunk must be >= 0 tokens (0: the whole prompt), got {chunk}")
        if chunk and not self.chunked_prefill:
            raise ValueError(self.chunk_error())
        if not chunk or chunk >= prompt_len:
            return [(0, prompt_len)]
        return prefill_steps(prompt_len, chunk, knee, cp)

    def chunk_error(self) -> str:
        """Why it refuses --prefill-chunk (where chunked_prefill is False)."""
        return f"--cp-strategy {self.name} prefills the whole prompt in one step; drop --prefill-chunk"

    def chunked_kv_rows(self, lay, w) -> tuple[int, int, int] | None:
        """kv_rows of a context strategy's chunked prefill (Workload.prefill_chunk), None where it runs in
        one step: each rank keeps rank_rows(chunk=) plus the decode tokens on the query rank; the largest
        forward is the first step's (the strategy's own prefill of prompt[0:end]) or a later step's
        zigzag shard, about chunk / cp rows (parallel/context/chunked.py)."""
        if self.single_rank or not self.chunked_prefill or not w.prefill_chunk:
            return None
        options = {k: v for k, v in (("block_size", lay.block_size), ("anchor_size", lay.anchor_size),
                                     ("query_rank", lay.query_rank), ("num_blocks", lay.num_blocks)) if v is not None}
        L, C = w.prompt_tokens, w.context
        bounds = self.prefill_bounds(lay.cp, L, C, options, w.prefill_chunk, w.prefill_knee)
        if len(bounds) == 1:
            return None
        q = query_rank(lay.cp, options)
        rows = self.rank_rows(lay.cp, L, C, options, w.prefill_chunk, w.prefill_knee)
        kept = max(n + (w.max_new_tokens if r == q else 0) for r, n in enumerate(rows))
        first, flight = self.first_step_rows(lay, w, bounds[0][1])
        step = max(2 * -(-(e - s) // (2 * lay.cp)) for s, e in bounds[1:])
        return kept, max(first, step), flight

    def first_step_rows(self, lay, w, end: int) -> tuple[int, int]:
        """(rows of the forward, transient KV tokens) of a chunked prefill's first step, prompt[0:end]."""
        _, rows, flight = self.kv_rows(lay, replace(w, prompt_tokens=end, context_tokens=end, prefill_chunk=None,
                                                    max_new_tokens=0))
        return rows, flight

    def rank_rows(self, cp: int, prompt_len: int, context_len: int, options: dict,
                  chunk: int | None = None, knee: int | None = None) -> list[int]:
        """KV rows each CP rank keeps for one prompt's prefill (real tokens: padding is never stored):
        its entry shard, plus on the query rank the query tokens where the strategy's query phase
        stores them (Star, APB). `context_len`: the prompt's document part (the exact strategies run
        the whole prompt and ignore it); `options`: field -> value of the options given; `chunk`: the
        prefill's step size and `knee` its taper (prefill_bounds), which lay the shards out step by step.
        The runner sizes each rank's cache by it and the service admits by it."""
        bounds = self.prefill_bounds(cp, prompt_len, context_len, options, chunk, knee)
        if len(bounds) == 1:
            return self.whole_rows(cp, prompt_len, context_len, options)
        return self.chunked_rows(cp, prompt_len, context_len, options, bounds)

    def whole_rows(self, cp: int, prompt_len: int, context_len: int, options: dict) -> list[int]:
        """rank_rows of a prefill in one step."""
        raise NotImplementedError

    def chunked_rows(self, cp: int, prompt_len: int, context_len: int, options: dict,
                     bounds: list[tuple[int, int]]) -> list[int]:
        """rank_rows of a prefill in steps `bounds`: the first step is the strategy's own prefill of
        prompt[0:end], each later one keeps the real rows of its zigzag shard of the step."""
        _, end = bounds[0]
        rows = self.whole_rows(cp, end, end, options)
        for s, e in bounds[1:]:
            rows = [n + zigzag_rows(e - s, cp, r) for r, n in enumerate(rows)]
        return rows

    def activation_elements(self, rows: int, heads: int, kv_heads: int, head_dim: int) -> int:
        """Planner: elements per batch row it holds beyond one layer's forward of `rows` rows."""
        return 0

    def prefill_flops(self, cfg: ModelConfig, prompt_len: int, context_len: int, strategy) -> list[PrefillFlops]:
        """Its FLOP model of one prefill, per rank; `strategy`: the built strategy (its cp and the sizes
        it resolved for this context)."""
        raise NotImplementedError
