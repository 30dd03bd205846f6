"""The generation loop, written once for every runner: prefill, then one token a step until EOS or
the budget. Every rank of a parallel group runs it in lockstep and gets the same tokens."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from starshard.config import SamplingConfig
from starshard.runtime.monitor import RunCallbacks
from starshard.runtime.prompt import Prompt


@dataclass
class Generation:
    tokens: list[int]
    finish_reason: str  # "eos" | "length"
    prefill_seconds: float
    decode_seconds: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def generate_tokens(runner, prompt: Prompt, *, max_new_tokens: int, sampling: SamplingConfig, eos_ids: set[int],
                    prefill_chunk: int | None = None, callbacks: RunCallbacks | None = None) -> Generation:
    """Run `prompt` through `runner` and sample up to `max_new_tokens` tokens (the EOS token, when
    sampled, is the last one returned)."""
    cb = callbacks or RunCallbacks()
    # dynamic-NTK / longrope frequencies depend on the run's length: one length for every token of
    # the run, on every rank (a no-op for the other RoPE types).
    runner.model.set_rope_length(len(prompt.ids) + max_new_tokens)
    # trim_local: nothing but this loop reads the cache, so a runner that can keeps only local layers' windows
    cache = runner.new_cache(len(prompt.ids) + max_new_tokens, len(prompt.ids), prompt.context_len, prefill_chunk,
                             trim_local=True)
    gen = None
    if sampling.seed is not None:
        gen = torch.Generator(device=cache.device).manual_seed(sampling.seed)
    t0 = time.perf_counter()
    cb.prefill_start(len(prompt.ids))
    tok = runner.prefill(prompt, cache, sampling, gen, prefill_chunk)
    _sync(cache.device)
    cb.prefill_end()
    t1 = time.perf_counter()
    out: list[int] = []
    finish = "length"
    try:
        while len(out) < max_new_tokens:
            t = int(tok)
            out.append(t)
            if t in eos_ids:
                finish = "eos"
                break
            if len(out) == max_new_tokens:
                break
            cb.decode_step(len(out))
            tok = runner.next_token(tok.view(1, 1), cache, sampling, gen)
        _sync(cache.device)
    finally:
        runner.end_generation()  # the cache goes with this call, not with the next one
    return Generation(out, finish, t1 - t0, time.perf_counter() - t1)
