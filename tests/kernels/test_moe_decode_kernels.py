"""kernels/moe_decode.py under the Triton interpreter: routing against engine/moe.py `route` and float64,
the expert GEMVs against a float64 per-token reference, the gate/up kernel that routes its tokens itself
against routing + gate/up launched apart and float64, and MoEFeedForward's decode path against its torch
path. Also: that kernel built for sm_90a waits on the kernels ahead before its first load."""
import pytest
import torch

pytest.importorskip("triton")

from tests.helpers.sm90_compile import assert_compiles_for_sm90  # noqa: E402

from starshard.config import ModelConfig  # noqa: E402
from starshard.engine.moe import MoEFeedForward, grouped_experts, route, use_decode_kernels  # noqa: E402
from starshard.kernels.fp8 import dequantize, quantize_rows  # noqa: E402
from starshard.kernels.moe_decode import (  # noqa: E402
    ROUTE_MAX_EXPERTS,
    expert_down,
    expert_gate_up,
    route_topk,
    routed_gate_up,
)


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


@pytest.mark.parametrize("T", [1, 3])
def test_e4m3_experts_against_float64(T):
    """e4m3 expert weights with one float32 scale per row (quantize_rows, as --fp8 experts stores them): the
    routed gate/up, the pre-routed gate/up and down kernels against float64 products with the dequantized
    weights; odd widths and small tiles so that rows and K tiles are masked."""
    g = torch.Generator().manual_seed(10 + T)
    E, k, H, F = 16, 4, 40, 37
    x = torch.randn(T, H, generator=g)
    w13_8, s13 = quantize_rows(torch.randn(E, 2 * F, H, generator=g) * 0.2)
    w2_8, s2 = quantize_rows(torch.randn(E, H, F, generator=g) * 0.2)
    assert w13_8.dtype == torch.float8_e4m3fn and s13.shape == (E, 2 * F) and s2.shape == (E, H)
    w13, w2 = dequantize(w13_8, s13, torch.float64), dequantize(w2_8, s2, torch.float64)
    logits = untied_logits(T, E, g, torch.float32)
    act, weights, experts = routed_gate_up(x, logits, w13_8, k, True, block_n=16, block_k=32, warps=1, w13_scale=s13)
    assert rel(act, _gate_up64(x, experts, w13)) <= 1e-6
    assert torch.equal(act, expert_gate_up(x, experts, w13_8, block_n=16, block_k=32, warps=1, w13_scale=s13))
    y = expert_down(act, experts, weights, w2_8, block_n=16, block_k=16, warps=1, w2_scale=s2)
    assert rel(y, _reference(x, weights, experts.long(), w13, w2)) <= 1e-6
    with pytest.raises(ValueError, match="w2_scale must be float32"):
        expert_down(act, experts, weights, w2_8, w2_scale=s2[:, :-1])
    with pytest.raises(ValueError, match="w13_scale must be float32"):
        routed_gate_up(x, logits, w13_8, k, True, w13_scale=s13.double())
    with pytest.raises(ValueError, match="e4m3 weights need their w13_scale"):
        routed_gate_up(x, logits, w13_8, k, True)  # unscaled e4m3 would be silently wrong
    with pytest.raises(ValueError, match="e4m3 weights need their w2_scale"):
        expert_down(act, experts, weights, w2.float(), w2_scale=s2)


def _gate_up64(x, experts, w13):
    """float64 silu(gate) * up of every (token, expert) pair, row t * k + j."""
    F = w13.shape[1] // 2
    k = experts.shape[1]
    h = torch.einsum("pnh,ph->pn", w13.double()[experts.reshape(-1).long()], x.double().repeat_interleave(k, 0))
    return torch.nn.functional.silu(h[:, :F]) * h[:, F:]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float16, 2e-3)])
@pytest.mark.parametrize("E,k", [(8, 1), (8, 8), (60, 2), (128, 8), (128, 1)])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("T", [1, 3])
def test_routed_gate_up_matches_route_topk_and_gate_up(T, E, k, renormalize, dtype, tol):
    """One launch against route_topk + expert_gate_up (the same bits) and against float64 (softmax, top k,
    renormalization, the pairs' GEMVs). F = 37 is no multiple of the column slice; T = 3 takes small tiles
    (masked K tiles too) and logits / x rows with a stride wider than a row; T = 1 the engine's tiles."""
    g = torch.Generator().manual_seed(T * 1000 + E * 10 + k)
    H, F = 40, 37
    logits = torch.zeros(T, E + 5, dtype=dtype)
    logits[:, :E] = untied_logits(T, E, g, dtype)
    logits = logits[:, :E] if T == 3 else logits[:, :E].contiguous()
    x = torch.randn(T, H + 8, generator=g).to(dtype)[:, :H]
    w13 = (torch.randn(E, 2 * F, H, generator=g) * 0.2).to(dtype)
    tile = dict(block_n=16, block_k=32, warps=1) if T == 3 else {}
    act, w, e = routed_gate_up(x, logits, w13, k, renormalize, **tile)
    assert act.shape == (T * k, F) and act.dtype == dtype
    assert w.shape == e.shape == (T, k) and w.dtype == torch.float32 and e.dtype == torch.int32
    want_w, want_e = route_topk(logits, k, renormalize)
    assert torch.equal(w, want_w) and torch.equal(e, want_e)
    assert torch.equal(act, expert_gate_up(x, want_e, w13, **tile))
    p64, e64 = logits.double().softmax(-1).topk(k, dim=-1)  # float64; untied: one top k whoever breaks ties
    if renormalize:
        p64 = p64 / p64.sum(-1, keepdim=True)
    assert torch.equal(e.long(), e64) and torch.allclose(w.double(), p64, rtol=2e-6, atol=1e-8)
    assert rel(act, _gate_up64(x, e64, w13)) <= tol


@pytest.mark.parametrize("renormalize", [True, False])
def test_routed_gate_up_ties_take_the_lowest_id(renormalize):
    """Equal logits: the lowest expert id first, as route_topk; a row of all-equal logits too."""
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 2.0, -1.0], [0.5] * 6, [3.0, -1.0, 3.0, 0.0, 0.0, 0.0]])
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    w13 = torch.randn(6, 2 * 5, 8, generator=torch.Generator().manual_seed(1))
    act, w, e = routed_gate_up(x, logits, w13, 3, renormalize)
    assert e.tolist() == [[1, 3, 4], [0, 1, 2], [0, 2, 3]]
    want_w, want_e = route_topk(logits, 3, renormalize)
    assert torch.equal(w, want_w) and torch.equal(e, want_e)
    p = logits.softmax(-1).gather(-1, e.long())
    assert torch.allclose(w, p / p.sum(-1, keepdim=True) if renormalize else p, rtol=1e-6)
    assert torch.equal(act, expert_gate_up(x, e, w13))


def test_routed_gate_up_no_tokens():
    act, w, e = routed_gate_up(torch.zeros(0, 8), torch.zeros(0, 6), torch.zeros(6, 10, 8), 2, True)
    assert act.shape == (0, 5) and w.shape == e.shape == (0, 2)


def test_routed_gate_up_rejects_bad_inputs():
    x, logits, w13 = torch.zeros(2, 8), torch.zeros(2, 6), torch.zeros(6, 10, 8)
    with pytest.raises(ValueError, match="top_k=0 of 6 experts"):
        routed_gate_up(x, logits, w13, 0, True)
    with pytest.raises(ValueError, match="top_k=7 of 6 experts"):
        routed_gate_up(x, logits, w13, 7, True)
    E = ROUTE_MAX_EXPERTS + 1
    with pytest.raises(ValueError, match=f"of {E} experts \\(at most {ROUTE_MAX_EXPERTS}\\)"):
        routed_gate_up(x, torch.zeros(2, E), torch.zeros(E, 2, 8), 2, True)
    with pytest.raises(ValueError, match="router logits must be"):
        routed_gate_up(x, logits[0], w13, 2, True)
    with pytest.raises(ValueError, match="6 router logits per token for 5 experts"):
        routed_gate_up(x, logits, w13[:5], 2, True)
    with pytest.raises(ValueError, match="x must be"):
        routed_gate_up(torch.zeros(2, 7), logits, w13, 2, True)  # hidden size
    with pytest.raises(ValueError, match="x must be"):
        routed_gate_up(torch.zeros(3, 8), logits, w13, 2, True)  # tokens
    with pytest.raises(ValueError, match="w13 must be"):
        routed_gate_up(x, logits, torch.zeros(6, 8, 10).transpose(1, 2), 2, True)


_COMPILE_ROUTED = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from starshard.kernels.moe_decode import _routed_gate_up_kernel as fn
ptrs = "x_ptr logit_ptr w_ptr s_ptr out_ptr weight_ptr expert_ptr".split()
for use, scaled in ((False, False), (True, False), (True, True)):
    kind = {"weight_ptr": "*fp32", "logit_ptr": "*fp32", "s_ptr": "*fp32", "expert_ptr": "*i32",
            "w_ptr": "*fp8e4nv" if scaled else "*bf16"}
    sig = {n: kind.get(n, "*bf16") if n in ptrs else "constexpr" if fn.params[i].is_constexpr else "i32"
           for i, n in enumerate(fn.arg_names)}
    const = dict(TOP_K=8, K_PAD=8, BLOCK_E=128, RENORMALIZE=True, HAS_SCALE=scaled, BLOCK_N=4, BLOCK_K=512,
                 USE_PDL=use)
    ptx = triton.compile(ASTSource(fn, sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 2}).asm["ptx"]
    assert ("griddepcontrol.wait" in ptx) == use and ("griddepcontrol.launch_dependents" in ptx) == use
    if use:  # no load or store of global memory before the wait
        first = min(ptx.index(op) for op in ("ld.global", "st.global"))
        assert ptx.index("griddepcontrol.launch_dependents") < ptx.index("griddepcontrol.wait") < first
print("compiled")
"""


def test_routed_gate_up_pdl_compiles_for_sm90(tmp_path):
    """kernels/pdl.py's rule: the logits and x are written by the kernels ahead, and which expert rows to
    load depends on the logits, so nothing of global memory is touched before the wait."""
    assert_compiles_for_sm90(_COMPILE_ROUTED, tmp_path)


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


@pytest.mark.parametrize("E,k,renormalize", [(128, 8, False), (8, 2, True), (60, 1, True)])
def test_moe_layer_decode_path_matches_torch_path(E, k, renormalize):
    """MoEFeedForward on decode-sized inputs: gate/up with the routing + down kernels (forced on the CPU)
    against the layer's torch path (route + grouped experts), with the same experts chosen, and bit-equal
    to routing, gate/up and down launched apart (grouped_experts' "gemv" path)."""
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
    with torch.no_grad():
        w, e = route_topk(logits, k, renormalize)
        apart = grouped_experts(x.view(-1, 48), w, e, moe.experts.w13, moe.experts.w2, impl="gemv")
    assert torch.equal(got.view(-1, 48), apart)
    r = torch.randn(3, 1, 48, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(moe(x, residual=r), got + r)  # residual into the down kernel (one device)
        moe.combine = lambda t: t.clone()  # as tensor parallelism's all-reduce: the residual added after it
        assert torch.equal(moe(x, residual=r), got + r)
        moe.decode_kernels = False
        assert torch.equal(moe(x, residual=r), want + r)
    for impl in ("gather", "padded"):  # the grouped reference paths, on the kernels' routing
        with torch.no_grad():
            w, e = route_topk(logits, k, renormalize)
            ref = grouped_experts(x.view(-1, 48), w, e.long(), moe.experts.w13, moe.experts.w2, impl=impl)
        assert rel(got.view(-1, 48), ref) <= 1e-6
