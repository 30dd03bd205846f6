"""kernels/moe_decode.py under the Triton interpreter: routing against engine/moe.py `route` and float64,
the expert GEMVs against a float64 per-token reference, and MoEFeedForward's decode path against its
torch path."""
import pytest
import torch

pytest.importorskip("triton")

from starshard.config import ModelConfig  # noqa: E402
from starshard.engine.moe import MoEFeedForward, grouped_experts, route, use_decode_kernels  # noqa: E402
from starshard.kernels.moe_decode import expert_down, expert_gate_up, route_topk  # noqa: E402


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def untied_logits(T, E, g, dtype):
    """Random logits with every pair of a row at least 1e-2 apart (after the cast to dtype), so the top k
    is one set whoever breaks ties: a random permutation of evenly spaced values, plus a row offset."""
    steps = torch.stack([torch.randperm(E, generator=g) for _ in range(T)]).float()
    logits = (steps - E / 2) * (8.0 / E) + torch.randn(T, 1, generator=g)
    out = logits.to(dtype)
    gaps = out.float().sort(dim=-1).values.diff(dim=-1)
    assert gaps.min() >= 1e-2
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("E,k", [(128, 8), (8, 2), (60, 4)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_topk_matches_route(E, k, renormalize, dtype):
    g = torch.Generator().manual_seed(E * 10 + k)
    T = 5
    logits = untied_logits(T, E, g, dtype)
    w, e = route_topk(logits, k, renormalize)
    assert w.dtype == torch.float32 and e.dtype == torch.int32 and w.shape == e.shape == (T, k)
    want_w, want_e = route(logits, k, renormalize)
    assert torch.equal(e.long(), want_e)  # the same experts, largest first
    assert torch.allclose(w, want_w, rtol=2e-6, atol=1e-7)
    p64 = logits.double().softmax(-1).gather(-1, want_e)  # float64: float32 rounding only
    if renormalize:
        p64 = p64 / p64.sum(-1, keepdim=True)
    assert torch.allclose(w.double(), p64, rtol=2e-6, atol=1e-8)


def test_route_topk_ties_take_the_lowest_id():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, -1.0]])
    w, e = route_topk(logits, 3, False)
    assert e.tolist() == [[1, 3, 4]] and torch.allclose(w, logits.softmax(-1)[:, [1, 3, 4]])


def _reference(x, weights, experts, w13, w2):
    """float64, token by token, pair by pair."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    F = w2.shape[-1]
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for wj, ej in zip(weights[t].double(), experts[t]):
            h = w13[ej] @ x[t]
            out[t] += wj * (w2[ej] @ (torch.nn.functional.silu(h[:F]) * h[F:]))
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 2e-3)])
@pytest.mark.parametrize("T", [1, 3, 5])
def test_fused_gate_up_and_down_against_float64(T, dtype, tol):
    """Odd widths (H = 40, F = 37) against small tiles so that column and K tiles are masked; one expert
    chosen by two tokens; int64 (route) or int32 (route_topk) expert ids."""
    g = torch.Generator().manual_seed(T)
    E, k, H, F = 16, 4, 40, 37
    x = torch.randn(T, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * F, H, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(E, H, F, generator=g) * 0.2).to(dtype)
    weights, experts = route(untied_logits(T, E, g, torch.float32), k, True)
    experts[:, 0] = 7  # a shared expert: pairs of different tokens read the same rows
    want = _reference(x, weights, experts, w13, w2)
    ids = experts.int() if T == 3 else experts
    act = expert_gate_up(x, ids, w13, block_n=16, block_k=32, warps=1)
    assert act.shape == (T * k, F) and act.dtype == dtype
    h = torch.einsum("pnh,ph->pn", w13.double()[experts.reshape(-1)], x.double().repeat_interleave(k, 0))
    assert rel(act, torch.nn.functional.silu(h[:, :F]) * h[:, F:]) <= tol
    y = expert_down(act, ids, weights, w2, block_n=16, block_k=16, warps=1)
    assert y.shape == (T, H) and y.dtype == dtype
    assert rel(y, want) <= tol, rel(y, want)
    if T == 1:  # default tiles; float32 out
        y32 = expert_down(act, ids, weights, w2, out_dtype=torch.float32)
        assert y32.dtype == torch.float32 and rel(y32, want) <= tol
    # the block's residual in the down kernel: exactly expert_down(...) + residual (two roundings)
    res = (50 * torch.randn(T, 2 * H, generator=g)).to(dtype)[:, ::2]
    fused = expert_down(act, ids, weights, w2, block_n=16, block_k=16, warps=1, residual=res)
    assert torch.equal(fused, y + res)


def _moe_layer(E, k, renormalize, H=48, F=24, seed=0):
    cfg = ModelConfig(arch="qwen3_moe", vocab_size=32, hidden_size=H, intermediate_size=64, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=12, num_experts=E, num_experts_per_tok=k,
                      moe_intermediate_size=F, norm_topk_prob=renormalize)
    moe = MoEFeedForward(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        moe.router.weight.copy_(torch.randn(E, H, generator=g) * 0.5)
        moe.experts.w13.copy_(torch.randn(E, 2 * F, H, generator=g) * 0.2)
        moe.experts.w2.copy_(torch.randn(E, H, F, generator=g) * 0.2)
    return moe


@pytest.mark.parametrize("E,k,renormalize", [(128, 8, False), (8, 2, True)])
def test_moe_layer_decode_path_matches_torch_path(E, k, renormalize):
    """MoEFeedForward on decode-sized inputs: routing + gate/up + down kernels (forced on the CPU) against
    the layer's torch path (route + grouped experts), with the same experts chosen."""
    moe = _moe_layer(E, k, renormalize)
    x = torch.randn(3, 1, 48, generator=torch.Generator().manual_seed(1))  # [B, L, H]: 3 decode tokens
    assert not use_decode_kernels(x.view(-1, 48), k, E)  # CPU: the torch path by default
    with torch.no_grad():
        logits = moe.router(x.view(-1, 48))
        gaps = logits.sort(dim=-1).values.diff(dim=-1)
        assert gaps.min() > 1e-5  # no near-ties: both paths pick the same experts
        want = moe(x)
        moe.decode_kernels = True
        got = moe(x)
        want64 = _reference(x.view(-1, 48), *route(logits, k, renormalize), moe.experts.w13, moe.experts.w2)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert rel(got, want) <= 1e-6 and rel(got.view(-1, 48), want64) <= 1e-6
    r = torch.randn(3, 1, 48, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(moe(x, residual=r), got + r)  # residual into the down kernel (one device)
        moe.decode_kernels = False
        assert torch.equal(moe(x, residual=r), want + r)
    for impl in ("gather", "padded"):  # the grouped reference paths, on the kernels' routing
        with torch.no_grad():
            w, e = route_topk(logits, k, renormalize)
            ref = grouped_experts(x.view(-1, 48), w, e.long(), moe.experts.w13, moe.experts.w2, impl=impl)
        assert rel(got.view(-1, 48), ref) <= 1e-6
