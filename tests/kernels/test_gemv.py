"""kernels/gemv.py (the decode GEMV, under the Triton interpreter) with 16-bit weights, and engine/linear.py
(the model's projections: the GEMV on CUDA for decode rows, F.linear elsewhere, the residual sum)."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from starshard.engine.linear import Linear, project_add  # noqa: E402
from starshard.kernels.gemv import GEMV_16BIT_TILE, GEMV_MAX_ROWS, gemv, gemv_16bit_tile, use_gemv  # noqa: E402


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_16bit_against_float64(M, bias):
    g = torch.Generator().manual_seed(M + 10 * bias)
    N, K = 37, 1500  # odd sizes: partial column and K tiles
    w = (torch.randn(N, K, generator=g) / K**0.5).half()
    x = torch.randn(M, K, generator=g).half()
    b = torch.randn(N, generator=g).half() if bias else None
    y = gemv(x, w, None, b, tile=dict(block_n=8, block_k=512, warps=1))
    want = x.double() @ w.double().t() + (b.double() if bias else 0)
    assert y.dtype == torch.float16 and y.shape == (M, N)
    assert ((y.double() - want).norm() / want.norm()).item() < 1e-3  # the output's fp16 rounding


def test_default_tiles_by_shape():
    """The tile gemv takes without one: 1024 columns per step at K = 2048 with many rows; up to 4096 where K
    >= 4096 or the weight has few rows; the wide tile over a K past 4096 with a partial last step is exact."""
    assert gemv_16bit_tile(5120, 2048) == GEMV_16BIT_TILE and gemv_16bit_tile(49152, 576) == GEMV_16BIT_TILE
    assert gemv_16bit_tile(2048, 4096)["block_k"] == 4096 and gemv_16bit_tile(4096, 14336)["block_k"] == 4096
    assert gemv_16bit_tile(128, 2048)["block_k"] == 2048 and gemv_16bit_tile(64, 300)["block_k"] == 1024
    g = torch.Generator().manual_seed(4)
    N, K = 6, 4100
    w, x = (torch.randn(N, K, generator=g) / K**0.5).half(), torch.randn(1, K, generator=g).half()
    want = x.double() @ w.double().t()
    assert ((gemv(x, w).double() - want).norm() / want.norm()).item() < 1e-3


def test_gemv_residual_rounds_as_torch():
    """+ residual after rounding the product to the output dtype: equal to gemv(x, w) + residual, which a
    single rounding of the exact sum would not be (large residual, fp16)."""
    g = torch.Generator().manual_seed(3)
    N, K = 40, 300
    w, x = (torch.randn(N, K, generator=g) / K**0.5).half(), torch.randn(2, K, generator=g).half()
    r = (300 * torch.randn(2, N, generator=g)).half()
    plain = gemv(x, w)
    assert torch.equal(gemv(x, w, residual=r), plain + r)
    assert torch.equal(gemv(x, w, residual=r.view(2, 1, N)), plain + r)  # reshaped to [M, N]


def test_gemv_refuses_bad_shapes():
    with pytest.raises(ValueError, match="at most"):
        gemv(torch.zeros(GEMV_MAX_ROWS + 1, 8), torch.zeros(4, 8))
    with pytest.raises(ValueError, match=r"expected x \[M, K\]"):
        gemv(torch.zeros(2, 8), torch.zeros(4, 9))


def test_linear_is_f_linear_off_cuda_and_adds_the_residual():
    g = torch.Generator().manual_seed(5)
    lin = Linear(24, 10)
    x, r = torch.randn(1, 1, 24, generator=g), torch.randn(1, 1, 10, generator=g)
    assert not use_gemv(x, lin.weight)  # CPU
    assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
    assert torch.equal(lin(x, residual=r), F.linear(x, lin.weight, lin.bias) + r)
    assert torch.equal(project_add(lin, x, r), lin(x) + r) and torch.equal(project_add(lin, x, None), lin(x))
    plain = torch.nn.Linear(24, 10)
    assert torch.equal(project_add(plain, x, r), plain(x) + r)
    assert set(lin.state_dict()) == set(plain.state_dict())  # checkpoints load as into nn.Linear


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA dispatch")
def test_linear_takes_the_gemv_for_decode_rows_on_cuda():
    lin = Linear(256, 64, bias=False).cuda().to(torch.bfloat16)
    one = torch.randn(1, 1, 256, device="cuda", dtype=torch.bfloat16)
    assert use_gemv(one, lin.weight) and not use_gemv(torch.randn(2, 256, device="cuda", dtype=torch.bfloat16), lin.weight)
    ref = F.linear(one.float(), lin.weight.float())
    assert ((lin(one).float() - ref).norm() / ref.norm()).item() < 1e-2
