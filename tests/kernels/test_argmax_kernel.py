"""kernels/argmax.py: greedy decoding's argmax (under the Triton interpreter) equals torch.argmax, ties,
NaN and infinities included."""
import pytest
import torch

pytest.importorskip("triton")

from starshard.config import SamplingConfig  # noqa: E402
from starshard.engine.sampling import sample  # noqa: E402
from starshard.kernels.argmax import ARGMAX_BLOCK, ARGMAX_CHUNK, argmax_rows, use_argmax_kernel  # noqa: E402


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _rows(V, B=3, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, V, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("V", [1, 7, ARGMAX_BLOCK, 3 * ARGMAX_BLOCK + 5, ARGMAX_CHUNK + 1, 49152])
def test_random_rows(V, dtype):
    x = _rows(V, seed=V, dtype=dtype)
    assert torch.equal(argmax_rows(x), x.argmax(-1))


@pytest.mark.parametrize("T", [ARGMAX_BLOCK, ARGMAX_CHUNK])
def test_ties_take_the_first_index_across_tiles_and_chunks(T):
    """T: the tile width (lanes of one program) or the chunk width (programs)."""
    ARGMAX_BLOCK = T
    V = 3 * ARGMAX_BLOCK + 11
    x = torch.zeros(4, V)
    x[0, [5, ARGMAX_BLOCK + 5, 2 * ARGMAX_BLOCK]] = 2.0  # same lane in two tiles, and another lane
    x[1, [ARGMAX_BLOCK - 1, ARGMAX_BLOCK + 3]] = 1.0  # the later tile holds the lower lane
    x[2, V - 1] = 1.0
    # row 3: all equal -> index 0
    got = argmax_rows(x)
    assert got.tolist() == [5, ARGMAX_BLOCK - 1, V - 1, 0]
    assert torch.equal(got, x.argmax(-1))


@pytest.mark.parametrize("T", [ARGMAX_BLOCK, ARGMAX_CHUNK])
def test_nan_and_infinities(T):
    ARGMAX_BLOCK = T
    V = 2 * ARGMAX_BLOCK + 3
    x = torch.zeros(5, V)
    x[0, [10, ARGMAX_BLOCK + 2]] = float("nan")
    x[0, 3] = float("inf")
    x[1, [ARGMAX_BLOCK + 7, 9]] = float("inf")
    x[2] = float("-inf")
    x[3] = float("-inf")
    x[3, V - 2] = -1e30
    x[4, ARGMAX_BLOCK + 1] = float("nan")
    x[4, 0] = float("nan")
    got = argmax_rows(x)
    assert got.tolist() == [10, 9, 0, V - 2, 0]
    assert torch.equal(got, x.argmax(-1))


def test_strided_rows_and_bad_shapes():
    x = _rows(2 * 5000, B=2, seed=4)[:, ::2]  # non-unit column stride: copied
    assert torch.equal(argmax_rows(x), x.argmax(-1))
    with pytest.raises(ValueError, match=r"expected logits \[B, V\]"):
        argmax_rows(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="zero width"):
        argmax_rows(torch.zeros(2, 0))


def test_greedy_sampling_uses_it_only_for_wide_cuda_rows():
    assert not use_argmax_kernel(torch.zeros(1, 128256))  # CPU: torch.argmax
    assert not use_argmax_kernel(torch.empty(1, 128256, device="meta"))
    x = _rows(300, B=2, seed=9)
    assert torch.equal(sample(x, SamplingConfig(temperature=0), None), x.argmax(-1))
