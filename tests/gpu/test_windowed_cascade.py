"""The service's batched decode step with windows on CUDA: the captured CUDA graph (CascadeGraph) of a
windowed, soft-capped model (tiny Gemma 2) equals the eager cascade and the model's own logits over each
row's whole sequence, for rows sharing all of a cached entry and only its first part. The CPU twin
(tests/serving/test_windowed_service.py) runs the graph's eager path; this one captures and replays."""
import pytest
import torch

from starshard import LLM
from starshard.engine.kv_cache import KVCache
from starshard.serving.cascade import CascadeAttention, CascadeGraph, OwnKV, SharedGroup, run_cascade
from tests.serving.test_windowed_service import _ids, paths  # noqa: F401 (the tiny models fixture)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="CUDA graphs need CUDA: run `python -m pytest tests/gpu` on a GPU machine")


def test_captured_cascade_step_with_windows(paths):  # noqa: F811
    model = LLM(paths["gemma2"], progress=False, device="cuda", dtype=torch.float32).model
    n = 40
    ids = torch.tensor([_ids(1, n)], device="cuda")
    entry = KVCache(model.layer_ids, 1, 2, 8, n, torch.float32, "cuda")
    with torch.inference_mode():
        model(ids, cache=entry, last_only=True)
        tok, pos = torch.tensor([[3], [4]], device="cuda"), torch.tensor([[n], [30]], device="cuda")
        outs = []
        for graph in (False, True):
            pool = OwnKV(model.layer_ids, 2, 2, 8, 4, torch.float32, "cuda")
            cascade = CascadeAttention([SharedGroup(entry, [0, 1], [n, 30], n)], pool, None, "cuda")
            step = CascadeGraph(model, cascade, 2, "cuda").step if graph else (
                lambda t, p, c=cascade: run_cascade(model, t, p, c))
            outs.append(torch.stack([step(tok, pos).clone(), step(tok + 1, pos + 1).clone()]))
        assert torch.allclose(outs[0], outs[1], atol=1e-4)
        for b, m in enumerate((n, 30)):
            seq = torch.cat([ids[:, :m], torch.tensor([[3 + b, 4 + b]], device="cuda")], 1)
            want = model(seq)[0, -2:]
            assert torch.allclose(outs[1][:, b], want, atol=1e-3), b
