"""kernels/kv_write.py: the one-launch decode KV write (under the Triton interpreter) against the torch
path LayerKV.write_slot runs on the CPU (write_kv_slot_reference): the written row, its scales and
position, and every other cache entry left as it was. The prefill block write (write_kv_block) against
quantize_rows, into the rows it is given and no others.

The interpreter's float32 -> e4m3 conversion drops the carry when a value rounds up across a power of
two (31.06 -> 16, not 32): the exact-bytes check writes into a float32 cache (the values before the
cast, cast here with torch); the e4m3-cache check allows exactly that error and nothing else."""
import pytest
import torch

pytest.importorskip("triton")

from starshard.kernels.fp8 import FP8_DTYPE  # noqa: E402
from starshard.engine.kv_cache import LayerKV  # noqa: E402
from starshard.kernels.fp8 import quantize_rows  # noqa: E402
from starshard.kernels.kv_write import (  # noqa: E402
    use_kv_write_kernel,
    write_kv_block,
    write_kv_slot,
    write_kv_slot_reference,
)

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


def new_block(n, D, dtype, seed):
    """k, v [B, H, n, D] as a prefill hands them: k contiguous (RoPE's output), v a view of the fused
    projection (GQA: 2H query heads); one all-zero row."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, n, 4 * H * D, generator=g) * torch.logspace(-2, 1, n)[None, :, None]
    k = qkv[..., 2 * H * D : 3 * H * D].view(B, n, H, D).transpose(1, 2).contiguous().to(dtype)
    qkv[0, n // 2, 3 * H * D : 3 * H * D + D] = 0
    v = qkv.to(dtype)[..., 3 * H * D :].view(B, n, H, D).transpose(1, 2)
    assert not v.is_contiguous() and (v[0, 0, n // 2] == 0).all()
    return k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("D,n,start", [(64, 37, 0), (96, 11, 2), (64, 1, CAP - 1)])
def test_block_write_values_and_scales(D, n, start, dtype):
    """Into a float32 cache (values before the e4m3 cast): quantize_rows' scales and values, exactly,
    in rows start .. start + n; every other row as it was."""
    cap = max(CAP, start + n)
    k, v = new_block(n, D, dtype, seed=D + n)
    g = torch.Generator().manual_seed(5)
    ck, cv = (100 * torch.randn(B, H, cap, D, generator=g) for _ in range(2))
    ks, vs = (torch.rand(B, H, cap, generator=g) for _ in range(2))
    before = [t.clone() for t in (ck, cv, ks, vs)]
    write_kv_block(k, v, start, ck, cv, ks, vs)
    for cache, scales, x, old_c, old_s in ((ck, ks, k, before[0], before[2]), (cv, vs, v, before[1], before[3])):
        x8, want_s = quantize_rows(x)
        rows = slice(start, start + n)
        assert torch.equal(scales[:, :, rows], want_s)
        assert torch.equal(cache[:, :, rows], (x.float() / want_s[..., None]).clamp(-448, 448))
        assert torch.equal(cache[:, :, rows].to(FP8_DTYPE).view(torch.uint8), x8.view(torch.uint8))
        keep = torch.ones(cap, dtype=torch.bool)
        keep[rows] = False
        assert torch.equal(cache[:, :, keep], old_c[:, :, keep]) and torch.equal(scales[:, :, keep], old_s[:, :, keep])
    assert vs[0, 0, start + n // 2] == 1e-12 / 448  # the all-zero row: the scale floor


def test_block_write_into_a_layer_cache_matches_the_torch_path(monkeypatch):
    """LayerKV.store of a prefill block into an FP8 cache: the kernel (as on CUDA) against the torch path."""
    k, v = new_block(29, 64, torch.float32, seed=8)
    caches = []
    for kernel in (False, True):
        monkeypatch.setattr("starshard.engine.kv_cache.use_kv_write_kernel", lambda t, on=kernel: on)
        cache = LayerKV(B, H, 64, 40, torch.float32, "cpu", fp8=True)
        cache.store(k[:, :, :5], v[:, :, :5], torch.arange(5))
        cache.store(k[:, :, 5:], v[:, :, 5:], torch.arange(5, 29))
        caches.append(cache)
    torch_path, kernel_path = caches
    assert kernel_path.length == torch_path.length == 29
    assert torch.equal(kernel_path.k_scale[:, :, :29], torch_path.k_scale[:, :, :29])
    assert torch.equal(kernel_path.v_scale[:, :, :29], torch_path.v_scale[:, :, :29])
    assert torch.equal(kernel_path.pos[:29], torch_path.pos[:29])
    for got, want in ((kernel_path.k, torch_path.k), (kernel_path.v, torch_path.v)):
        differ = got[:, :, :29].view(torch.uint8) != want[:, :, :29].view(torch.uint8)
        # the interpreter's dropped carry only (module docstring): the reference rounded up onto a power of
        # two, the kernel's byte lies below it, at most a binade low (the largest subnormal below 2^-6)
        w, gv = want[:, :, :29][differ].float(), got[:, :, :29][differ].float()
        assert (w.abs() == 2 ** w.abs().log2().round()).all() and (gv.sign() == w.sign()).all()
        assert ((gv.abs() < w.abs()) & (gv.abs() >= w.abs() / 2)).all() and differ.float().mean() < 0.2


def test_block_write_rejects_bad_input():
    k = torch.zeros(B, H, 4, 8)
    ck, ks = torch.zeros(B, H, CAP, 8), torch.zeros(B, H, CAP)
    with pytest.raises(ValueError, match="rows 11 .. 15 of a cache of 13"):
        write_kv_block(k, k, 11, ck, ck, ks, ks)
    with pytest.raises(ValueError, match="k, v \\[B, Hkv, n, D\\]"):
        write_kv_block(k, k[:, :, :3], 0, ck, ck, ks, ks)
