"""kernels/norm.py: the decode RMSNorm kernel (under the Triton interpreter) against float64."""
import pytest
import torch

pytest.importorskip("triton")

from starshard.kernels.norm import NORM_MAX_ROWS, rms_norm, rms_norm_reference, use_norm_kernel  # noqa: E402


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,D", [(1, 4096), (5, 100), (33, 128), (3, 576)])
def test_rms_norm_against_float64(rows, D, dtype):
    g = torch.Generator().manual_seed(rows * 1000 + D)
    x = (3 * torch.randn(rows, D, generator=g)).to(dtype)
    w = torch.randn(D, generator=g)
    eps = 1e-5
    ref = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + eps) * w.double()
    y = rms_norm(x, w, eps)
    assert y.dtype == dtype and y.shape == x.shape
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    assert ((y.double() - ref).norm() / ref.norm()).item() < tol
    assert torch.allclose(y, rms_norm_reference(x, w, eps), rtol=tol, atol=tol)


def test_rms_norm_strided_heads():
    """Per-head norms of a q slice of a fused projection (Qwen3 q_norm): rows that are not one stride apart."""
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(2, 3, 8 * 16 + 2 * 2 * 16, generator=g)
    q = qkv[..., : 8 * 16].view(2, 3, 8, 16)
    w = torch.rand(16, generator=g) + 0.5
    assert torch.allclose(rms_norm(q, w, 1e-6), rms_norm_reference(q, w, 1e-6), rtol=1e-6, atol=1e-6)


def test_kernel_is_chosen_for_few_rows_on_cuda_only():
    assert not use_norm_kernel(torch.zeros(1, 4096))  # CPU: torch path
    meta = torch.empty(NORM_MAX_ROWS + 1, 64, device="meta")
    assert not use_norm_kernel(meta)
