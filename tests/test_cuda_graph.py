"""The device-indexed decode step that CUDA graphs replay (engine/cuda_graph.py), run eagerly on
CPU: same logits and cache as plain decode, step after step, and it declines a full cache."""
import torch

from hf_models import make_hf_model
from starshard.checkpoints.load import load_model
from starshard.engine.cuda_graph import GraphDecoder
from starshard.engine.generate import LocalRunner


def test_device_indexed_step_equals_plain_decode(tmp_path):
    _, path = make_hf_model("llama", tmp_path, num_attention_heads=6, num_key_value_heads=2, hidden_size=48)
    model = load_model(path)
    runner = LocalRunner(model)
    ids = torch.randint(0, 211, (1, 23), generator=torch.Generator().manual_seed(3))
    steps = 7
    plain, graphed = runner.new_cache(23 + steps), runner.new_cache(23 + steps)
    dec = GraphDecoder(model, graphed, capture=False)
    with torch.no_grad():
        model(ids, cache=plain)
        model(ids, cache=graphed)
        tok = torch.tensor([[5]])
        for _ in range(steps):
            want = model(tok, cache=plain, last_only=True)
            got = dec.step(tok)
            assert ((got - want).norm() / want.norm()).item() <= 1e-5
            tok = want[:, -1].argmax(-1, keepdim=True)
    assert graphed.length == plain.length == 23 + steps and graphed.next_position == plain.next_position
    for i in model.layer_ids:
        (k1, v1, p1), (k2, v2, p2) = plain.layer(i).view(), graphed.layer(i).view()
        assert torch.equal(p1, p2) and torch.allclose(k1, k2, atol=1e-6) and torch.allclose(v1, v2, atol=1e-6)
    assert not dec.fits()  # full: the next step must grow the cache, which a graph cannot follow


def test_step_with_a_sparse_method_installed(tmp_path):
    """Layers with a sparse prefill method call their hook with sparse=; decode stays dense."""
    from starshard.kernels.minference import MInferenceConfig
    from starshard.kernels.sparse import install_sparse

    _, path = make_hf_model("llama", tmp_path)
    model = load_model(path)
    install_sparse(model, MInferenceConfig())
    cache = LocalRunner(model).new_cache(30)
    ids = torch.randint(0, 211, (1, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        model(ids, cache=cache)
        got = GraphDecoder(model, cache, capture=False).step(torch.tensor([[7]]))
        want = model(torch.cat([ids, torch.tensor([[7]])], 1))[:, -1:]
    assert ((got - want).norm() / want.norm()).item() <= 1e-5


def test_runner_uses_graphs_only_on_cuda_single_token(tmp_path):
    from starshard.parallel.context import make_strategy
    from starshard.parallel.context.runner import ContextParallelRunner

    _, path = make_hf_model("llama", tmp_path)
    runner = LocalRunner(load_model(path))
    cache = runner.new_cache(40)
    assert runner.decode_is_local()
    assert runner._graph_decoder(torch.tensor([[1]]), cache) is None  # CPU cache
    assert ContextParallelRunner(load_model(path), make_strategy("star")).decode_is_local()  # cp = 1
