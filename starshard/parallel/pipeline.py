"""Pipeline parallelism: which layers each stage holds, and how activations move between stages.

Stage s runs its slice of layers on each chunk of tokens and hands the hidden states to stage s+1
with an asynchronous send, so while stage s+1 works on chunk c, stage s already runs chunk c+1:
a long prompt's prefill keeps every stage busy once the pipeline is full. Every stage appends
each chunk's KV to its own cache, so chunking changes nothing in the result. Decode sends one
token's hidden state through the stages; the last stage samples and broadcasts the token.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from starshard.partition import prefill_steps


def chunk_bounds(length: int, chunk: int | None, knee: int | None = None) -> list[tuple[int, int]]:
    """[start, end) of each prefill chunk (partition.prefill_steps: tapered after `knee` held tokens, None:
    uniform); every stage derives the same list from the prompt length."""
    if chunk is not None and chunk < 1:
        raise ValueError(f"--prefill-chunk must be >= 1, got {chunk}")
    return prefill_steps(length, chunk or length, knee)


class StageLink:
    """Point-to-point hand-off between neighbouring stages of one pipeline (the topology's pp group).

    Each TP rank of stage s talks to the TP rank of the same index on stage s+1 (they share a pp
    group), so the hidden state, already complete on every TP rank, moves without a gather.
    """

    def __init__(self, group, ranks: list[int], stage: int):
        self.group, self.ranks, self.stage = group, ranks, stage
        self.stages = len(ranks)
        self._pending: list[tuple[object, torch.Tensor]] = []

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    def send_next(self, x: torch.Tensor) -> None:
        """Asynchronous: the caller goes on with its next chunk while this one travels."""
        x = x.contiguous()
        work = dist.isend(x, dst=self.ranks[self.stage + 1], group=self.group)
        self._pending.append((work, x))  # the buffer must outlive the send

    def recv_prev(self, shape, dtype, device) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(buf, src=self.ranks[self.stage - 1], group=self.group)
        return buf

    def flush(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    def broadcast_from_last(self, t: torch.Tensor) -> torch.Tensor:
        """The last stage's value of `t` on every stage (e.g. the sampled token)."""
        if self.stages > 1:
            t = t.contiguous()
            dist.broadcast(t, src=self.ranks[-1], group=self.group)
        return t


def run_stage(model, ids: torch.Tensor, cache, link: StageLink | None, chunk: int | None = None,
              last_only: bool = True) -> torch.Tensor | None:
    """Run `ids` [B, L] through this stage, `chunk` tokens at a time, appending KV to `cache`.

    First stage embeds the ids; later stages receive each chunk's hidden states [B, n, hidden] from
    the previous stage. Returns the last stage's output (logits, or their vocab shard under TP):
    the final token's with `last_only`, else every token's; None on the other stages.
    """
    B, L = ids.shape
    hidden = model.config.hidden_size
    dtype = model.layers[0].attention_norm.weight.dtype
    outs = []
    for s, e in chunk_bounds(L, chunk):
        if link is None or link.is_first:
            x = ids[:, s:e]
        else:
            x = link.recv_prev((B, e - s, hidden), dtype, ids.device)
        out = model(x, cache=cache, last_only=last_only)
        if link is not None and not link.is_last:
            link.send_next(out)
        elif not last_only or e == L:
            outs.append(out)
    if link is not None:
        link.flush()
        if not link.is_last:
            return None
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
