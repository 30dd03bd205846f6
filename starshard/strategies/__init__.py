"""The context strategies' registry, pure part: each strategy's name, options (with their flags),
refusals, KV rows per rank, FLOP model and what it composes with, one module per strategy
(StrategySpec, spec.py). The planner, the CLI, the runtime build, LLM and the benchmarks read it;
parallel/context/ holds the torch classes under the same names.

Adding a strategy: its spec module here (registered in SPECS), its torch class in parallel/context/
(registered in CLASSES there), and tests.
"""
from __future__ import annotations

from starshard.strategies.apb import APB
from starshard.strategies.dense import DENSE
from starshard.strategies.ring import RING
from starshard.strategies.spec import QUERY_RANK, Option, StrategySpec
from starshard.strategies.star import STAR
from starshard.strategies.ulysses import ULYSSES
from starshard.strategies.usp import USP

SPECS: dict[str, StrategySpec] = {s.name: s for s in (DENSE, RING, ULYSSES, USP, STAR, APB)}
STRATEGIES = tuple(SPECS)  # --cp-strategy's choices, in this order
SINGLE_RANK = next(s.name for s in SPECS.values() if s.single_rank)  # the whole sequence on one CP rank
CP_DEFAULT = RING.name  # a CP group's strategy when none is named (exact, every model)


def default_name(cp: int) -> str:
    """The strategy that runs when --cp-strategy is not given: the one-rank strategy on one CP rank, else CP_DEFAULT."""
    return SINGLE_RANK if cp == 1 else CP_DEFAULT

# Every option by field, each strategy's in registry order, then the one every strategy reads.
OPTIONS: dict[str, Option] = {o.field: o for s in SPECS.values() for o in s.options} | {QUERY_RANK.field: QUERY_RANK}


def get_spec(name: str) -> StrategySpec:
    if name not in SPECS:
        raise ValueError(f"unknown --cp-strategy {name!r}; choose one of {', '.join(STRATEGIES)}")
    return SPECS[name]


def owner(option: Option) -> StrategySpec:
    """The strategy that declares an exclusive option."""
    return next(s for s in SPECS.values() if option in s.options)


def given_options(source) -> dict:
    """The strategy options `source` (a ParallelConfig, parsed flags) sets: field -> value, None left out."""
    return {f: getattr(source, f) for f in OPTIONS if getattr(source, f, None) is not None}


def _names(names: list[str], last: str = "or") -> str:
    return ", ".join(names[:-1]) + f" {last} {names[-1]}" if len(names) > 1 else names[0]


def check(name: str, cp: int, options: dict) -> None:
    """Refuse (ValueError naming the fix) strategy `name` on `cp` ranks with `options` (field -> value,
    unset ones None or absent): an unknown name, a query rank outside the group, a one-rank strategy on a CP
    group, another strategy's exclusive options, and the strategy's own rules (StrategySpec.validate)."""
    spec = get_spec(name)
    options = {k: v for k, v in options.items() if v is not None}
    q = options.get(QUERY_RANK.field)
    if q is not None and not 0 <= q < cp:
        raise ValueError(f"{QUERY_RANK.flag} {q} is outside the CP group of {cp} ranks: give 0..{cp - 1} (default: "
                         f"the last, {cp - 1})")
    if spec.single_rank and cp > 1:
        raise ValueError(f"cp={cp} needs a context strategy: --cp-strategy "
                         f"{_names([s.name for s in SPECS.values() if not s.single_rank])}")
    foreign = [OPTIONS[k] for k in options if OPTIONS[k].exclusive and OPTIONS[k] not in spec.options]
    if foreign:
        home = owner(foreign[0]).name
        raise ValueError(f"{', '.join(o.flag for o in foreign)} only apply to --cp-strategy {home} (got {name}); "
                         f"drop them or use --cp-strategy {home}")
    spec.validate(cp, options)


def sparse_error(name: str) -> str | None:
    """Why --sparse cannot run inside strategy `name` (None: it can)."""
    if get_spec(name).sparse:
        return None
    return (f"--sparse does not compose with --cp-strategy {name}: its patterns are estimated over a row's whole key "
            f"range, which a ring step never sees; use {_names([s.name for s in SPECS.values() if s.sparse])}")


def fp8_attention_error(name: str, cp: int, sparse: bool) -> str | None:
    """Why --fp8 attention (8-bit prefill scores, wired into the square causal calls of the strategies
    with `fp8_attention`, never with --sparse) cannot run with this layout (None: it can)."""
    if get_spec(name).fp8_attention is not None and not sparse:
        return None
    wired = sorted((s for s in SPECS.values() if s.fp8_attention is not None), key=lambda s: s.name)
    return (f"--fp8 attention (8-bit prefill scores) runs {_names([s.fp8_attention for s in wired], 'and')}, without "
            f"--sparse; got --cp {cp} --cp-strategy {name}" + (" with --sparse" if sparse else "")
            + f": drop `attention` from --fp8, or use --cp-strategy {' / '.join(s.name for s in wired)} without --sparse")

