"""kernels/activation.py silu_mul_rows: SwiGLU's activation in one launch (under the Triton interpreter),
decode and prefill tiles, against float64 and against eager torch's two roundings."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from starshard.kernels.activation import (SILU_MUL_BLOCK, SILU_MUL_DECODE_ROWS, SILU_MUL_PREFILL_MIN_ROWS,  # noqa: E402
                                          SILU_MUL_PREFILL_TILE, silu_mul, silu_mul_rows, silu_mul_tile,
                                          use_silu_mul_kernel)


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1, 14336), (3, 100), (2, 5, 2 * SILU_MUL_BLOCK + 7), (1, 2),
                                   (SILU_MUL_DECODE_ROWS + 3, 300), (2, 40, SILU_MUL_PREFILL_TILE["block"] + 5)])
def test_silu_mul_rows_against_float64(shape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    gate_up = (4 * torch.randn(*shape[:-1], 2 * shape[-1], generator=g)).to(dtype)
    y = silu_mul_rows(gate_up)
    assert y.dtype == dtype and y.shape == (*shape[:-1], shape[-1])
    gate, up = gate_up.double().chunk(2, dim=-1)
    exact = gate * torch.sigmoid(gate) * up
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    assert ((y.double() - exact).norm() / exact.norm()).item() < tol
    # eager torch rounds silu's result, then the product: the kernel does the same
    a, b = gate_up.float().chunk(2, dim=-1)
    eager = (F.silu(a).to(dtype).float() * b).to(dtype)
    assert torch.allclose(y, eager, rtol=tol, atol=tol)


def test_silu_mul_rows_strided_input():
    """A non-contiguous [.., 2F] view (a slice of a wider buffer) gives what its contiguous copy gives."""
    g = torch.Generator().manual_seed(3)
    buf = torch.randn(4, 2 * 300 + 10, generator=g)
    view = buf[:, 5:5 + 600]
    assert torch.equal(silu_mul_rows(view), silu_mul_rows(view.contiguous()))


def test_silu_mul_rows_refuses_odd_width():
    with pytest.raises(ValueError, match="odd width"):
        silu_mul_rows(torch.zeros(2, 5))


def test_kernel_is_chosen_on_cuda_only():
    assert not use_silu_mul_kernel(torch.zeros(1, 28672))  # CPU: torch ops
    assert use_silu_mul_kernel(torch.empty(1, 28672, device="meta")) is False  # not CUDA
    cpu = torch.randn(2, 64)
    gate, up = cpu.chunk(2, dim=-1)
    assert torch.equal(silu_mul(cpu), F.silu(gate) * up)


def test_tiles_by_rows():
    """Decode rows: short programs; more rows: the prefill tile, capped at the row's padded width."""
    assert silu_mul_tile(SILU_MUL_DECODE_ROWS, 14336) == dict(block=SILU_MUL_BLOCK, warps=4)
    assert silu_mul_tile(1, 300) == dict(block=512, warps=2)
    assert silu_mul_tile(SILU_MUL_DECODE_ROWS + 1, 14336) == SILU_MUL_PREFILL_TILE
    assert silu_mul_tile(SILU_MUL_DECODE_ROWS + 1, 300)["block"] == 512


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA dispatch")
def test_cuda_dispatch():
    """Decode rows and long prefills: the kernel; short prefills (bound by the host's launches): torch ops."""
    assert use_silu_mul_kernel(torch.empty(SILU_MUL_DECODE_ROWS, 256, device="cuda"))
    assert not use_silu_mul_kernel(torch.empty(SILU_MUL_DECODE_ROWS + 1, 256, device="cuda"))
    assert not use_silu_mul_kernel(torch.empty(SILU_MUL_PREFILL_MIN_ROWS - 1, 256, device="cuda"))
    assert use_silu_mul_kernel(torch.empty(2, SILU_MUL_PREFILL_MIN_ROWS // 2, 256, device="cuda"))
    assert not use_silu_mul_kernel(torch.empty(1, 255, device="cuda"))
