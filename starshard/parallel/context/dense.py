"""Dense: the whole prompt on one rank; the reference every other strategy is tested against."""
from __future__ import annotations

import torch

from starshard.engine.model import dense_attend
from starshard.parallel.context.base import ContextStrategy, Segment
from starshard.strategies import check


class DenseContext(ContextStrategy):
    name = "dense"

    def __init__(self, group=None, query_rank=None):
        super().__init__(group, query_rank)
        check(self.name, self.cp, {})

    def segments(self, prompt_len: int, context_len: int) -> list[Segment]:
        index = torch.arange(prompt_len)
        return [Segment(index, index.clone())]

    def prefill_attend(self, segment: Segment):
        return dense_attend
