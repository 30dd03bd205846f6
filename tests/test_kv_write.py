"""kernels/kv_write.py: the one-launch decode KV write (under the Triton interpreter) against the torch
path LayerKV.write_slot runs on the CPU (write_kv_slot_reference): the written row, its scales and
position, and every other cache entry left as it was.

The interpreter's float32 -> e4m3 conversion drops the carry when a value rounds up across a power of
two (31.06 -> 16, not 32): the exact-bytes check writes into a float32 cache (the values before the
cast, cast here with torch); the e4m3-cache check allows exactly that error and nothing else."""
import pytest
import torch

pytest.importorskip("triton")

from starshard.kernels.fp8 import FP8_DTYPE  # noqa: E402
from starshard.kernels.kv_write import use_kv_write_kernel, write_kv_slot, write_kv_slot_reference  # noqa: E402

B, H, CAP, SLOT = 2, 3, 13, 6


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def new_token(D, dtype, seed):
    """k, v [B, H, 1, D] as the model hands them: transposed [B, 1, H, D] slices of a fused q/k/v
    projection (GQA: 2H query heads), so not contiguous; one all-zero row (its scale is the 1e-12 floor)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, 1, 4 * H * D, generator=g)
    qkv[..., 2 * H * D : 3 * H * D] *= 4
    qkv[1, 0, (2 * H + 2) * D : (2 * H + 3) * D] = 0
    qkv = qkv.to(dtype)
    k = qkv[..., 2 * H * D : 3 * H * D].view(B, 1, H, D).transpose(1, 2)
    v = qkv[..., 3 * H * D :].view(B, 1, H, D).transpose(1, 2)
    assert not k.is_contiguous() and (k[1, 2] == 0).all()
    return k, v


def held_cache(D, store_dtype, fp8, seed):
    """A cache already holding entries everywhere (so that a stray write shows), as a list
    [k, v, pos, k_scale, v_scale]."""
    g = torch.Generator().manual_seed(seed + 1)
    k = (100 * torch.randn(B, H, CAP, D, generator=g)).to(store_dtype)
    v = (100 * torch.randn(B, H, CAP, D, generator=g)).to(store_dtype)
    pos = torch.randperm(CAP, generator=g) + 1000
    scales = [torch.rand(B, H, CAP, generator=g) for _ in range(2)] if fp8 else [None, None]
    return [k, v, pos] + scales


def copy(cache):
    return [None if t is None else t.clone() for t in cache]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("D", [64, 96])
def test_fp8_values_before_the_cast_give_the_reference_bytes(D, dtype):
    k, v = new_token(D, dtype, seed=D)
    pos, slot = torch.tensor([777]), torch.tensor([SLOT])
    ref = held_cache(D, FP8_DTYPE, True, seed=D)
    out = copy(ref)
    out[0], out[1] = ref[0].float(), ref[1].float()  # float32 cache: the kernel's values before the cast
    write_kv_slot_reference(k, v, pos, slot, *ref)
    write_kv_slot(k, v, pos, slot, *out)
    for got, want, x, scale in zip(out[:2], ref[:2], (k, v), ref[3:]):
        # division, as quantize_rows (a multiply by 1 / scale differs in the last bits)
        assert torch.equal(got[:, :, SLOT], (x[:, :, 0].float() / scale[:, :, SLOT, None]).clamp(-448, 448))
        assert torch.equal(got.to(FP8_DTYPE).view(torch.uint8), want.view(torch.uint8))
    for got, want in zip(out[2:], ref[2:]):
        assert torch.equal(got, want)
    assert ref[3][1, 2, SLOT] > 0 and (ref[2] == 777).sum() == 1


@pytest.mark.parametrize("D", [64, 96])
def test_fp8_cache_bytes(D):
    """Into a real e4m3 cache: the reference's bytes, but for the interpreter's dropped carry."""
    k, v = new_token(D, torch.float32, seed=10 + D)
    pos, slot = torch.tensor([5]), torch.tensor([SLOT])
    ref = held_cache(D, FP8_DTYPE, True, seed=D)
    out = copy(ref)
    write_kv_slot_reference(k, v, pos, slot, *ref)
    write_kv_slot(k, v, pos, slot, *out)
    for got, want in zip(out[:2], ref[:2]):
        differ = got.view(torch.uint8) != want.view(torch.uint8)
        w = want[differ].float()
        assert (w.abs() == 2 ** w.abs().log2().round()).all()  # rounded up onto a power of two ...
        assert torch.equal(got[differ].float(), w / 2)  # ... where the interpreter lands one binade low
        assert differ[:, :, SLOT].float().mean() < 0.2 and not differ[:, :, :SLOT].any()
    for got, want in zip(out[2:], ref[2:]):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("D", [64, 96])
def test_plain_cache(D, dtype):
    k, v = new_token(D, dtype, seed=20 + D)
    pos, slot = torch.tensor([123456789012]), torch.tensor([SLOT])
    ref = held_cache(D, dtype, False, seed=D)
    out = copy(ref)
    write_kv_slot_reference(k, v, pos, slot, *ref)
    write_kv_slot(k, v, pos, slot, *out)
    for got, want in zip(out[:3], ref[:3]):
        assert torch.equal(got, want)
    assert torch.equal(out[0][:, :, SLOT], k[:, :, 0]) and out[2][SLOT] == 123456789012


@pytest.mark.parametrize("fp8", [False, True])
def test_host_slot_matches_device_slot(fp8):
    """LayerKV.store (eager decode) passes the slot as a host int."""
    k, v = new_token(64, torch.float32, seed=3)
    pos = torch.tensor([9])
    dev = held_cache(64, torch.float32, fp8, seed=4)
    host = copy(dev)
    write_kv_slot(k, v, pos, torch.tensor([CAP - 1]), *dev)
    write_kv_slot(k, v, pos, CAP - 1, *host)
    for a, b in zip(dev, host):
        assert (a is None and b is None) or torch.equal(a, b)
    assert dev[2][CAP - 1] == 9


def test_kernel_is_chosen_on_cuda_only():
    assert not use_kv_write_kernel(torch.zeros(1, 1, 4, 8))  # CPU: LayerKV keeps the torch path
    assert not use_kv_write_kernel(torch.empty(1, 1, 4, 8, device="meta"))
