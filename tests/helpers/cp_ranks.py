"""Per-rank body shared by the multi-rank strategy tests: prefill + greedy decode under a strategy."""
from __future__ import annotations

import torch
import torch.distributed as dist

from starshard.checkpoints.load import load_model
from starshard.config import SamplingConfig
from starshard.runtime.context_parallel import ContextParallelRunner


def strategy_rank(rank, world, path, ids, context_len, make_strategy, steps):
    """Returns the owner's last-token logits, greedy tokens, and this rank's cache sizes."""
    model = load_model(path)
    runner = ContextParallelRunner(model, make_strategy(dist.group.WORLD))
    cache = runner.new_cache(len(ids) + steps)
    with torch.no_grad():
        logits, owner = runner.prefill_logits(ids, context_len, cache)
        after_prefill = cache.length
        tok = runner._broadcast_token(logits[:, -1].argmax(-1), owner)
        toks = [int(tok)]
        for _ in range(steps - 1):
            tok = runner.next_token(tok.view(1, 1), cache, SamplingConfig(), None)
            toks.append(int(tok))
    return {"logits": logits[0, -1], "owner": owner, "tokens": toks,
            "after_prefill": after_prefill, "final": cache.length,
            "positions": cache.layer(0).view()[2].clone()}


def dense_greedy(path, ids, steps: int) -> tuple[torch.Tensor, list[int]]:
    """The single-process reference: the prompt's last-row logits and `steps` greedy tokens, each step a
    whole forward of the sequence so far (no cache)."""
    model = load_model(path)
    seq, toks = torch.as_tensor(ids)[None], []
    with torch.no_grad():
        first = model(seq)[0, -1]
        for _ in range(steps):
            t = int(model(seq)[0, -1].argmax())
            toks.append(t)
            seq = torch.cat([seq, torch.tensor([[t]])], dim=1)
    return first, toks
