"""One forward pass with a look at each layer's queries and keys: what the offline sparse tools
(minference_search, anchor_calibrate) measure their patterns on."""
from __future__ import annotations

from collections.abc import Callable

import torch


def window_error(model, length: int) -> str | None:
    """Why a sample of `length` tokens cannot be probed (positions past the model's window: attention the model
    never runs, so patterns found there would be wrong), or None."""
    window = model.config.max_position_embeddings
    if length <= window:
        return None
    return (f"the sample is {length} tokens, past the model's window of {window}: lower --length to at most "
            f"{window}, or extend the window with --rope-scaling yarn:FACTOR (as the runs will use)")


def probe_layers(model, ids: list[int], observe: Callable[[int, torch.Tensor, torch.Tensor], None],
                 layers=None) -> None:
    """Run `ids` through `model` once (no grad, last token's logits only); as each selected layer's
    attention runs, call observe(layer index, q, k) with its post-RoPE queries and keys. The attention
    itself runs unchanged, and each layer's previous attention is back afterwards, also on error."""
    if (error := window_error(model, len(ids))) is not None:
        raise ValueError(error)
    want = set(range(len(model.layers))) if layers is None else set(layers)

    def wrap(i, fn):
        def attend(q, k, v, pos, cache, sparse=None, **extras):  # extras: the layer's window, softcap, scale
            if i in want:
                observe(i, q, k)
            return fn(q, k, v, pos, cache, sparse=sparse, **extras)

        return attend

    hooks = [wrap(i, fn) for i, fn in enumerate(model.layer_attends())]
    with model.attention_hooks(hooks), torch.no_grad():
        dev = next(model.parameters()).device
        model(torch.tensor([ids], device=dev), last_only=True)
