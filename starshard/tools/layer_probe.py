"""One forward pass with a look at each layer's queries and keys: what the offline sparse tools
(minference_search, anchor_calibrate) measure their patterns on."""
from __future__ import annotations

from collections.abc import Callable

import torch


def probe_layers(model, ids: list[int], observe: Callable[[int, torch.Tensor, torch.Tensor], None],
                 layers=None) -> None:
    """Run `ids` through `model` once (no grad, last token's logits only); as each selected layer's
    attention runs, call observe(layer index, q, k) with its post-RoPE queries and keys. The attention
    itself runs unchanged, and each layer's previous attention is back afterwards, also on error."""
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
