"""kernels/rope.py: the fused (norm +) RoPE kernel under the Triton interpreter against float64, on
q / k laid out as Attention.forward hands them over (transposed views of the fused qkv projection)."""
import pytest
import torch

pytest.importorskip("triton")

from starshard.config import ModelConfig, RopeScaling  # noqa: E402
from starshard.engine import model as model_mod  # noqa: E402
from starshard.engine.model import RMSNorm, Transformer, apply_rope  # noqa: E402
from starshard.kernels.rope import rope_qk, rope_qk_reference, use_rope_kernel  # noqa: E402


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def qkv_views(B, L, Hq, Hkv, D, dtype, g):
    """q [B, Hq, L, D], k [B, Hkv, L, D]: non-contiguous views of one [B, L, (Hq + 2 Hkv) D] projection."""
    qkv = (2 * torch.randn(B, L, (Hq + 2 * Hkv) * D, generator=g)).to(dtype)
    q, k, _ = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    return q.view(B, L, Hq, D).transpose(1, 2), k.view(B, L, Hkv, D).transpose(1, 2)


def angles(B, L, half, per_row, dtype, g):
    """cos / sin as Transformer.rope makes them: float32 angles, then the model dtype."""
    pos = torch.randint(0, 100_000, (B, L) if per_row else (L,), generator=g)
    inv = 1.0 / (10_000.0 ** (torch.arange(half, dtype=torch.float32) / half))
    f = pos.float()[..., None] * inv
    return f.cos().to(dtype), f.sin().to(dtype)


def float64_rope(x, cos, sin, w, eps):
    x = x.double()
    if w is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    return apply_rope(x, cos.double(), sin.double())


def rel_err(y, ref):
    return ((y.double() - ref).norm() / ref.norm()).item()


CASES = [  # B, L, Hq, Hkv, D, R (rotary dims), per-row cos
    (1, 1, 8, 2, 64, 64, False),      # decode, GQA
    (2, 21, 6, 3, 32, 32, True),      # odd L, batch of two with its own positions
    (2, 5, 4, 4, 48, 16, False),      # partial rotary (Phi-3 style), MHA, a head dim that is not a power of 2
    (1, 19, 5, 1, 80, 64, True),      # partial rotary, GQA, odd head count
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("norm", [False, True], ids=["rope", "qk_norm+rope"])
@pytest.mark.parametrize("B,L,Hq,Hkv,D,R,per_row", CASES)
def test_rope_qk_against_float64(B, L, Hq, Hkv, D, R, per_row, norm, dtype):
    g = torch.Generator().manual_seed(B * 1000 + L * 10 + D + R)
    q, k = qkv_views(B, L, Hq, Hkv, D, dtype, g)
    assert L == 1 or q.stride(2) == k.stride(2) == (Hq + 2 * Hkv) * D  # token rows of the projection, not of q
    cos, sin = angles(B, L, R // 2, per_row, dtype, g)
    qw, kw = (torch.rand(D, generator=g) + 0.5, torch.rand(D, generator=g) + 0.5) if norm else (None, None)
    eps = 1e-6
    qo, ko = rope_qk(q, k, cos, sin, qw, kw, eps)
    qr, kr = rope_qk_reference(q, k, cos, sin, qw, kw, eps)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    for y, x, w, ref in ((qo, q, qw, qr), (ko, k, kw, kr)):
        assert y.shape == x.shape and y.dtype == dtype and y.is_contiguous()
        exact = float64_rope(x, cos, sin, w, eps)
        assert rel_err(y, exact) < tol
        assert rel_err(ref, exact) < tol
        assert torch.allclose(y, ref, rtol=tol, atol=tol)
        if R < D and w is None:  # dims past the rotary ones pass through untouched
            assert torch.equal(y[..., R:], x[..., R:])


def test_reference_is_apply_rope_and_rmsnorm():
    """Without rounding in between (float32), the reference is the model's torch path: RMSNorm, apply_rope."""
    g = torch.Generator().manual_seed(3)
    for R, norm in ((32, False), (32, True), (16, False), (16, True)):
        q, k = qkv_views(2, 7, 4, 2, 32, torch.float32, g)
        cos, sin = angles(2, 7, R // 2, True, torch.float32, g)
        qn, kn = RMSNorm(32, 1e-6), RMSNorm(32, 1e-6)
        with torch.no_grad():
            qn.weight.copy_(torch.rand(32, generator=g) + 0.5)
            kn.weight.copy_(torch.rand(32, generator=g) + 0.5)
        with torch.no_grad():
            qm = qn(q.transpose(1, 2)).transpose(1, 2) if norm else q
            km = kn(k.transpose(1, 2)).transpose(1, 2) if norm else k
            want = apply_rope(qm, cos, sin), apply_rope(km, cos, sin)
        got = rope_qk_reference(q, k, cos, sin, qn.weight if norm else None, kn.weight if norm else None, 1e-6)
        for a, b in zip(got, want):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)
            if not norm:
                assert torch.equal(a, b)


@pytest.mark.parametrize("arch,qk_norm,partial", [("llama", False, 1.0), ("qwen3", True, 0.5)])
def test_attention_forward_through_the_kernel(monkeypatch, arch, qk_norm, partial):
    """Attention.forward's kernel branch (forced on CPU, interpreted) gives the torch branch's logits:
    the q / k views, norm weights, eps and cos / sin reach the kernel as the torch path uses them."""
    cfg = ModelConfig(arch=arch, vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=16, qk_norm=qk_norm, rms_norm_eps=1e-3,
                      rope_scaling=RopeScaling(partial_rotary_factor=partial))
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.5 + (1.0 if p.dim() == 1 else 0.0))
    tokens = torch.randint(0, 40, (2, 5))
    positions = torch.tensor([[3, 4, 5, 6, 7], [90, 91, 92, 93, 94]])
    with torch.no_grad():
        want = model(tokens, positions=positions)
        monkeypatch.setattr(model_mod, "use_rope_kernel", lambda x: True)
        got = model(tokens, positions=positions)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_kernel_runs_on_cuda_only():
    assert not use_rope_kernel(torch.zeros(1, 8, 1, 128))  # CPU: the torch path, bit for bit
    assert not use_rope_kernel(torch.zeros(1, 8, 1, 2048, device="meta"))
