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


def layers_error(layers: list[int] | None, num_layers: int) -> str | None:
    """Why `layers` (--layers, parsed) cannot be probed in a model of `num_layers` layers, or None."""
    if layers is None:
        return None
    bad = sorted({i for i in layers if not 0 <= i < num_layers})
    if not layers or bad:
        return (f"--layers names {bad or 'no layer'}: the model has layers 0..{num_layers - 1}; "
                "name layers among them, or drop --layers to take every layer")
    return None


class _Observed(Exception):
    """Raised once the last selected layer is observed: the layers above it would only cost time."""


def probe_layers(model, ids: list[int], observe: Callable[[int, torch.Tensor, torch.Tensor], None],
                 layers=None) -> None:
    """Run `ids` through `model` once (no grad), up to the last selected layer; as each selected layer's
    attention runs, call observe(layer index, q, k) with its post-RoPE queries and keys. The attention
    itself runs unchanged, and each layer's previous attention is back afterwards, also on error."""
    if (error := window_error(model, len(ids))) is not None:
        raise ValueError(error)
    want = set(range(len(model.layers))) if layers is None else set(layers)
    if not want:
        return
    last = max(want)

    def wrap(i, fn):
        def attend(q, k, v, pos, cache, sparse=None, **extras):  # extras: the layer's window, softcap, scale
            if i in want:
                observe(i, q, k)
            if i == last:
                raise _Observed
            return fn(q, k, v, pos, cache, sparse=sparse, **extras)

        return attend

    hooks = [wrap(i, fn) for i, fn in enumerate(model.layer_attends())]
    with model.attention_hooks(hooks), torch.no_grad():
        dev = next(model.parameters()).device
        try:
            model(torch.tensor([ids], device=dev), last_only=True)
        except _Observed:
            pass
