"""The device-indexed decode step that CUDA graphs replay (engine/cuda_graph.py), run eagerly on
CPU: same logits and cache as plain decode, step after step, and it declines a full cache."""
import torch

from tests.helpers.hf_models import make_hf_model
from starshard.checkpoints.load import load_model
from starshard.runtime.cuda_graph import GraphDecoder
from starshard.runtime.local import LocalRunner


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
    from starshard.runtime.context_parallel import ContextParallelRunner

    _, path = make_hf_model("llama", tmp_path)
    runner = LocalRunner(load_model(path))
    cache = runner.new_cache(40)
    assert runner.decode_is_local()
    assert runner._graph_decoder(torch.tensor([[1]]), cache) is None  # CPU cache
    assert ContextParallelRunner(load_model(path), make_strategy("star")).decode_is_local()  # cp = 1


def _sharded_step_rank(rank, world, path, strategy_name):
    """Both decode paths over a CP group: the eager strategy hook and the device-indexed graph step."""
    import torch.distributed as dist

    from starshard.parallel.context import make_strategy
    from starshard.runtime.context_parallel import ContextParallelRunner

    model = load_model(path)
    runner = ContextParallelRunner(model, make_strategy(strategy_name, dist.group.WORLD))
    s = runner.strategy
    ids = torch.randint(0, 211, (37,), generator=torch.Generator().manual_seed(5))
    plain, graphed = runner.new_cache(37 + 8), runner.new_cache(37 + 8)
    out = []
    with torch.no_grad():
        runner.prefill_logits(ids, 33, plain)
        runner.prefill_logits(ids, 33, graphed)
        dec = GraphDecoder(model, graphed, capture=False, group=s.group, appends=s.is_query_rank)
        tok = torch.tensor([[5]])
        for _ in range(6):
            with model.attention_hooks(s.decode_attend):  # the strategy's own decode hook
                want = model(tok, cache=plain, last_only=True)
            got = dec.step(tok)
            out.append((((got - want).norm() / want.norm()).item()))
            tok = want[:, -1].argmax(-1, keepdim=True)
            dist.broadcast(tok, src=s.query_rank)  # the query rank's logits decide (as the runner does)
    return {"errs": out, "query": s.is_query_rank, "lengths": (plain.length, graphed.length),
            "next": (plain.next_position, graphed.next_position),
            "kv": [torch.equal(plain.layer(i).view()[2], graphed.layer(i).view()[2]) for i in model.layer_ids]}


def test_sharded_graph_step_equals_eager_sharded_decode(tmp_path):
    """The step a CP rank's CUDA graph records (merge over the group inside, KV appended on the query
    rank only), run eagerly on gloo: same logits as the strategy's own decode hook, step after step,
    for ring (exact) and Star (query phase), and only the query rank's cache grows."""
    from tests.helpers.mp_harness import run_ranks

    _, path = make_hf_model("llama", tmp_path, num_attention_heads=6, num_key_value_heads=2, hidden_size=48)
    for name in ("ring", "star"):
        res = run_ranks(_sharded_step_rank, 2, path, name)
        assert sum(r["query"] for r in res) == 1
        for r in res:
            assert max(r["errs"]) <= 1e-5, (name, r["errs"])
            assert r["lengths"][0] == r["lengths"][1] and r["next"][0] == r["next"][1] and all(r["kv"])
        q = next(r for r in res if r["query"])
        other = next(r for r in res if not r["query"])
        assert q["lengths"][0] > other["lengths"][0]  # 6 decode tokens stored on the query rank alone


def _tp_step_rank(rank, world, path):
    from starshard import LLM
    from starshard.config import ParallelConfig, SamplingConfig

    llm = LLM(path, parallel=ParallelConfig(tp=2), progress=False)
    model, runner = llm.model, llm.runner
    ids = torch.randint(0, 211, (1, 29), generator=torch.Generator().manual_seed(6))
    plain, graphed = runner.new_cache(29 + 6), runner.new_cache(29 + 6)
    errs = []
    with torch.no_grad():
        model(ids, cache=plain)
        model(ids, cache=graphed)
        dec = GraphDecoder(model, graphed, capture=False)
        tok = torch.tensor([[5]])
        for _ in range(6):
            want = model(tok, cache=plain, last_only=True)  # this rank's vocab shard of the logits
            got = dec.step(tok)
            errs.append(((got - want).norm() / want.norm()).item())
            tok = runner.sampler(want[:, -1], SamplingConfig(), None).view(1, 1)  # greedy over the shards
    return {"errs": errs, "lengths": (plain.length, graphed.length)}


def test_tensor_parallel_graph_step_equals_eager(tmp_path):
    """tp=2: the step ParallelRunner's CUDA graph records (row-parallel all-reduces inside, vocab-shard
    logits out) equals the eager tensor-parallel step on gloo, step after step."""
    from tests.helpers.mp_harness import run_ranks

    _, path = make_hf_model("llama", tmp_path, num_attention_heads=6, num_key_value_heads=2, hidden_size=48)
    for r in run_ranks(_tp_step_rank, 2, path):
        assert max(r["errs"]) <= 1e-5, r["errs"]
        assert r["lengths"][0] == r["lengths"][1] == 29 + 6
