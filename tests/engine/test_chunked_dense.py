"""A chunked prefill on one device (the model with a KV cache, a block after held entries) gives every
row's logits of the whole prompt run at once: the held prefix attended without a mask and the block's
own keys causally, merged by lse (engine/model.py dense_attend, kernels/attention.py attention_after_held)."""
from __future__ import annotations

import torch

from starshard import LLM
from starshard.kernels.common import DECODE_MAX_ROWS


def _logits(llm, ids, chunk):
    cache = llm.runner.new_cache(len(ids))
    with torch.inference_mode():
        return torch.cat([llm.model(torch.tensor([ids[s : s + chunk]]), cache=cache, last_only=False)
                          for s in range(0, len(ids), chunk)], dim=1)


def test_chunked_prefill_equals_the_whole_prompt():
    llm = LLM(random_weights="tiny", progress=False)
    ids = torch.randint(0, 512, (69,), generator=torch.Generator().manual_seed(7)).tolist()
    whole = _logits(llm, ids, len(ids))
    for chunk in (DECODE_MAX_ROWS + 1, 30):  # prefill-sized blocks after held entries; 30 leaves a short tail
        got = _logits(llm, ids, chunk)
        assert got.shape == whole.shape
        assert ((got - whole).norm() / whole.norm()).item() < 1e-5
