"""Context strategies: how a CP group shares one sequence. All implement ContextStrategy (base.py);
each is registered under its name in starshard/strategies/, which holds its options and refusals."""
from __future__ import annotations

from starshard.parallel.context.apb import APBAttention
from starshard.parallel.context.base import ContextStrategy, group_size
from starshard.parallel.context.dense import DenseContext
from starshard.parallel.context.ring import RingAttention
from starshard.parallel.context.star import StarAttention
from starshard.parallel.context.ulysses import UlyssesAttention
from starshard.parallel.context.usp import UspAttention
from starshard.strategies import OPTIONS, check
from starshard.strategies.apb import APB

# The torch class of each registered strategy (starshard.strategies.SPECS), by name.
CLASSES: dict[str, type[ContextStrategy]] = {
    cls.name: cls for cls in (DenseContext, RingAttention, UlyssesAttention, UspAttention, StarAttention, APBAttention)}


def make_strategy(name: str, group=None, *, cp_groups=None, tp_group=None, **options) -> ContextStrategy:
    """The strategy `name` over `group` (None = a single rank), checked by its registry entry first.

    options: the strategy options by ParallelConfig field (starshard.strategies.OPTIONS; None = the
    strategy's default; one strategy's exclusive options are refused with any other).
    cp_groups: every CP group of the world as global ranks (usp creates its subgroups collectively);
    tp_group: APB's retaining heads."""
    unknown = [k for k in options if k not in OPTIONS]
    if unknown:
        raise TypeError(f"make_strategy() got unexpected keyword(s) {', '.join(unknown)}")
    options = {k: v for k, v in options.items() if v is not None}
    check(name, group_size(group), options)
    return CLASSES[name].from_options(group, options, cp_groups=cp_groups, tp_group=tp_group)


def apb_options(parallel) -> dict:
    """The APB-only options a ParallelConfig sets (None = the strategy's default)."""
    return {o.field: getattr(parallel, o.field) for o in APB.options
            if o.exclusive and getattr(parallel, o.field, None) is not None}
