"""Context strategies on models with sliding windows (issue 38): ring (zigzag, edges only for local
layers), Ulysses, USP and the chunked ring prefill on cp=2 gloo ranks equal the float32 single-process
model for a windowed Mistral (window 16, a 70-token prompt) and a tiny Gemma 2 (alternating windows,
soft-caps, query_pre_attn_scalar): first-token logits within the exact tests' tolerance and 6 greedy
tokens equal (so the sharded decode is covered). A local layer's ring sends only its window's edge
(bytes counted), steps wholly outside every query's window are skipped; Star and APB run their local
layers exactly (the previous block's window edge travels): with every layer local they equal dense.
Sparse methods bind global layers only.

One spawn runs every multi-rank case (spawning dominates the run time)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import transformers

from tests.helpers.cp_ranks import dense_greedy
from tests.helpers.hf_models import make_hf_model
from tests.helpers.mp_harness import run_ranks
from starshard.checkpoints.load import load_model
from starshard.config import Fp8Config, ParallelConfig, SamplingConfig
from starshard.kernels.attention import attention
from starshard.llm import check_attention_kinds
from starshard.parallel.context import make_strategy
from starshard.parallel.context.apb import APBAttention
from starshard.parallel.context.ring import (
    EdgePlan, RingPlan, gather_ring_plan, plan_steps, ring_attention, zigzag_positions, zigzag_ring_plan,
)
from starshard.parallel.context.star import StarAttention
from starshard.parallel.topology import LayoutError
from starshard.runtime.context_parallel import ContextParallelRunner
from starshard.runtime.prompt import Prompt

transformers.logging.set_verbosity_error()

W = 16
L = 70
STEPS = 6
TOL = 1e-4  # the exact CP tests' tolerance (float32 on CPU)
MODELS = {
    "mistral": ("mistral", dict(sliding_window=W)),
    "gemma2": ("gemma2", dict(sliding_window=W, query_pre_attn_scalar=10, attn_logit_softcapping=2.0,
                              final_logit_softcapping=3.0)),
}
CASES = [("ring", None, {}), ("ulysses", None, {}), ("ring", 24, {}), ("usp", None, {"ulysses_degree": 1})]
# Star on the all-local Mistral: every layer's query sees [anchor; previous block's edge; block] under its
# window, which is exactly its dense keys (the anchor approximates global layers only): Star equals dense.
# Anchors of 4 tokens: a block's first 15 queries need the previous block's last keys (edges travel).
STAR_CASES = [("star", None, {"anchor_size": 4}), ("star", 10, {"block_size": 35, "anchor_size": 4}),
              ("apb", None, {"anchor_size": 4})]  # APB: the same edges; anchors and passing serve global layers


def _ids() -> list[int]:
    return torch.randint(0, 211, (L,), generator=torch.Generator().manual_seed(5)).tolist()


def _generate(model, strategy, chunk, kv_fp8=False):
    runner = ContextParallelRunner(model, strategy, kv_fp8=kv_fp8)
    logits, step = {}, [0]

    def sample(lg, sampling, gen):  # the sampling rank's logits of each token
        logits[step[0]] = lg[0].clone()
        return lg.argmax(-1)

    runner.sample = sample
    cache = runner.new_cache(L + STEPS, L, L, chunk)
    with torch.no_grad():
        tok = runner.prefill(Prompt(_ids(), L), cache, SamplingConfig(), None, chunk)
        toks = [int(tok)]
        for i in range(1, STEPS):
            step[0] = i
            tok = runner.next_token(tok.view(1, 1), cache, SamplingConfig(), None)
            toks.append(int(tok))
    return {"logits": logits, "tokens": toks, "wire": strategy.wire.kv_bytes}


def _kernel_cases(rank, world):
    """ring_attention itself on zigzag shards against one-process attention over the whole sequence:
    the edge plan (zigzag, self-attention) and the ring with skipped steps (a gathered plan)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 72, 8, generator=g)
    k, v = torch.randn(1, 2, 72, 8, generator=g), torch.randn(1, 2, 72, 8, generator=g)
    pos = torch.arange(72)
    mine = zigzag_positions(72, world, rank)
    out = {}
    for window in (1, 5, 40):
        kw = dict(window=window, softcap=1.5, scale=0.3)
        want, want_lse = attention(q, k, v, q_pos=pos, k_pos=pos, causal=True, **kw)
        for name, plan in (("edges", zigzag_ring_plan(72, dist.group.WORLD)),
                           ("steps", gather_ring_plan(mine, mine, dist.group.WORLD))):
            got, lse = ring_attention(q[:, :, mine], k[:, :, mine], v[:, :, mine], mine, mine, dist.group.WORLD,
                                      plan=plan, **kw)
            out[(name, window)] = (type(plan.windowed(window)).__name__, (got - want[:, :, mine]).abs().max().item(),
                                   (lse - want_lse[:, :, mine]).abs().max().item())
    # FP8 on the wire: the edges and the ring both dequantize what arrives and attend their own block as given
    kw = dict(window=5, softcap=1.5, scale=0.3, fp8=True)
    fp8 = [ring_attention(q[:, :, mine], k[:, :, mine], v[:, :, mine], mine, mine, dist.group.WORLD, plan=plan, **kw)[0]
           for plan in (zigzag_ring_plan(72, dist.group.WORLD), gather_ring_plan(mine, mine, dist.group.WORLD))]
    want, _ = attention(q, k, v, q_pos=pos, k_pos=pos, causal=True, window=5, softcap=1.5, scale=0.3)
    out["fp8"] = ((fp8[0] - fp8[1]).abs().max().item(), (fp8[0] - want[:, :, mine]).abs().max().item())
    return out


def _world(rank, world, paths):
    out = {"kernel": _kernel_cases(rank, world)}
    for name, path in paths.items():
        model = load_model(path)
        for strategy, chunk, options in CASES:
            s = make_strategy(strategy, dist.group.WORLD, cp_groups=[list(range(world))], **options)
            out[(name, strategy, chunk)] = _generate(model, s, chunk)
        if name == "mistral":
            for strategy, chunk, options in STAR_CASES:
                s = make_strategy(strategy, dist.group.WORLD, cp_groups=[list(range(world))], **options)
                out[(name, strategy, chunk)] = _generate(model, s, chunk)
            s = make_strategy("star", dist.group.WORLD, anchor_size=4)  # edges travel as e4m3 + scales
            out[(name, "star-fp8", None)] = _generate(model, s, None, kv_fp8=True)
            try:  # two blocks on one rank: refused on every rank before any transfer
                _generate(model, make_strategy("star", dist.group.WORLD, block_size=20), None)
            except ValueError as e:
                out["star-blocks"] = str(e)
            # the same ring with every layer global: whole blocks travel
            model.drop_windows()
            out[(name, "ring-global", None)] = _generate(model, make_strategy("ring", dist.group.WORLD), None)
    return out


_RESULTS: dict = {}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    base = tmp_path_factory.mktemp("cpwin")
    return {name: make_hf_model(arch, base / name, eos_token_id=None, initializer_range=0.1, **kw)[1]
            for name, (arch, kw) in MODELS.items()}


@pytest.fixture(scope="module")
def results(paths):
    if "r" not in _RESULTS:
        _RESULTS["r"] = run_ranks(_world, 2, paths)
    return _RESULTS["r"]


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _dense(path):
    return dense_greedy(path, _ids(), STEPS)


def _check_equal(results, key, first, tokens):
    steps = {}
    for r in results:
        assert not steps.keys() & r[key]["logits"].keys()  # one rank samples each token
        steps |= r[key]["logits"]
    assert sorted(steps) == list(range(STEPS)), key
    assert _rel(steps[0], first) <= TOL, (key, _rel(steps[0], first))
    for r in results:
        assert r[key]["tokens"] == tokens, key


def test_star_and_apb_with_every_layer_local_equal_one_process(paths, results):
    first, tokens = _dense(paths["mistral"])
    for strategy, chunk, _ in STAR_CASES:
        _check_equal(results, ("mistral", strategy, chunk), first, tokens)
    row = 2 * 8 * 4  # KV heads x head_dim x float32 bytes
    # blocks of 35: rank 0 sends its last W - 1 keys of each of 3 local layers (K and V), rank 1 nothing
    for strategy in ("star", "apb"):
        assert [r[("mistral", strategy, None)]["wire"] for r in results] == [3 * 2 * (W - 1) * row, 0], strategy
    assert [r[("mistral", "star-fp8", None)]["wire"] for r in results] == [3 * 2 * (W - 1) * 2 * (8 + 4), 0]
    fp8 = next(r[("mistral", "star-fp8", None)]["logits"][0] for r in results if 0 in r[("mistral", "star-fp8", None)]["logits"])
    assert 0 < _rel(fp8, first) < 5e-2  # e4m3 keys (edges and the query phase's cache reads) against float32
    assert "one block per CP rank" in results[0]["star-blocks"] and "sliding_window=16" in results[0]["star-blocks"]
    # one device, three virtual hosts: the edges come from the cache
    model = load_model(paths["mistral"])
    for strategy in (StarAttention(None, num_blocks=3, anchor_size=4), APBAttention(None, num_blocks=3, anchor_size=4)):
        runner = ContextParallelRunner(model, strategy)
        with torch.no_grad():
            logits, _ = runner.prefill_logits(torch.tensor(_ids()), L - 1, runner.new_cache(L + 1))
        assert _rel(logits[0, -1], first) <= TOL, strategy.name


@pytest.mark.parametrize("model", sorted(MODELS))
def test_strategies_equal_one_process(paths, results, model):
    first, tokens = _dense(paths[model])
    # Guards the comparison: the same model without its windows is another model.
    m = load_model(paths[model])
    m.drop_windows()
    with torch.no_grad():
        assert _rel(m(torch.tensor([_ids()]))[0, -1], first) > 1e-2
    for strategy, chunk, _ in CASES:
        _check_equal(results, (model, strategy, chunk), first, tokens)


def test_local_layers_send_only_the_window_edge(results):
    """cp=2, L=70: zigzag chunks of 18 rows (padded to 72), each rank needs the W - 1 keys before its
    chunk that sits behind the other rank's: per local layer each rank sends 15 rows of K and V
    (Mistral: 3 local layers, 2 KV heads of 8), against its whole 36-row block when every layer is global."""
    row = 2 * 8 * 4  # KV heads x head_dim x float32 bytes
    for r in results:
        assert r[("mistral", "ring", None)]["wire"] == 3 * 2 * (W - 1) * row
        assert r[("mistral", "ring-global", None)]["wire"] == 3 * 2 * 36 * row


def test_ring_attention_with_windows_is_exact(results):
    for r in results:
        kernel = dict(r["kernel"])
        edges_vs_ring, vs_exact = kernel.pop("fp8")
        assert edges_vs_ring < 1e-5 and 0 < vs_exact < 0.1, (edges_vs_ring, vs_exact)
        for (name, window), (kind, err, lse_err) in kernel.items():
            assert kind == ("EdgePlan" if name == "edges" else "RingPlan"), (name, window)
            assert err < 1e-5 and lse_err < 1e-5, (name, window, err, lse_err)


def test_ring_steps_outside_every_window_are_skipped():
    """cp=4 zigzag over 128 positions (chunks of 16; rank 0 holds 0..15 and 112..127): with a window of
    20 rank 0 needs keys 93..111 only, so the step that computes rank 3's block (48..79) has no call,
    while every step has calls when all keys are visible."""
    pos = [zigzag_positions(128, 4, r) for r in range(4)]
    full, local = plan_steps(pos[0], pos, 0), plan_steps(pos[0], pos, 0, window=20)
    assert all(full) and local[1] == () and all(local[s] for s in (0, 2, 3))
    assert sum(map(len, local)) < sum(map(len, full))


def test_edge_plan_receives_exactly_the_window_edges():
    """The edge plan of rank 1 (chunks 16..31 and 96..111) at window 8: the 7 keys before each chunk,
    from the ranks holding chunks 0 and 5; at a window past what one block can hold, the ring."""
    pos = [zigzag_positions(128, 4, r) for r in range(4)]
    plan = RingPlan(1, 4, 2, 0, 32, 32, 2, torch.stack(pos), plan_steps(pos[1], pos, 1), tuple(pos), pos[1],
                    (0, 1, 2, 3), self_attention=True)
    edges = plan.windowed(8)
    assert isinstance(edges, EdgePlan)
    assert sorted(edges.k_pos.tolist()) == list(range(9, 16)) + list(range(89, 96))
    assert dict(edges.recv) == {0: 7, 2: 7} and edges.recv_rows == 14
    assert [d for d, _ in edges.send] == [0, 2]  # rank 0's chunk 7 needs 105..111, rank 2's chunk 2 needs 25..31
    assert isinstance(plan.windowed(40), RingPlan) and plan.windowed(40) is plan.windowed(40)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_strategy_takes_windows(paths, name):
    cfg = load_model(paths[name]).config
    for strategy in ("ring", "ulysses", "usp", "star", "apb"):
        assert check_attention_kinds(cfg, ParallelConfig(cp=2, cp_strategy=strategy), None, Fp8Config()) is None


def test_sparse_prefill_runs_global_layers_only(paths):
    """A sparse method binds the global layers only (local ones attend their window densely); a model with
    soft-caps stays refused (the patterns take none), naming the field and the fix."""
    from starshard.kernels.sparse import SparseConfig, install_sparse, load_sparse_method

    sparse = SparseConfig("minference", min_length=0)
    model = load_model(paths["gemma2"])
    install_sparse(model, load_sparse_method(sparse))
    assert [layer.attention.sparse is None for layer in model.layers] == [
        "window" in layer.attention.extras for layer in model.layers] == [True, False, True]
    assert check_attention_kinds(load_model(paths["mistral"]).config, ParallelConfig(), sparse, Fp8Config()) is None
    with pytest.raises(LayoutError, match=r"sparse prefill \(minference\) does not run gemma2's sliding_window / "
                                          r"attn_logit_softcapping.*without --sparse"):
        check_attention_kinds(model.config, ParallelConfig(), sparse, Fp8Config())
