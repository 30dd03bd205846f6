"""FP8 prefill with the activation quantization fused into the norm / silu-mul (issue 19):
kernels/activation.py under the Triton interpreter against float64, Fp8Linear's fused branch, and
parallel/fp8.fuse_inputs leaving a model's CPU numbers exactly as they were.

The interpreter's float32 -> e4m3 conversion drops the carry when a value rounds up across a power of
two (31.06 -> 16, not 32), so kernel tests take the kernels' values before the cast (out_dtype=float32)
and cast with torch; the GPU's conversion is checked by bench/fp8_prefill_fused.py (fused vs unfused)."""
import pytest
import torch

pytest.importorskip("triton")

from starshard.config import ModelConfig  # noqa: E402
from starshard.engine.model import FeedForward, RMSNorm, Transformer  # noqa: E402
from starshard.kernels import activation  # noqa: E402
from starshard.engine.linear import Linear, project_heads  # noqa: E402
from starshard.kernels.activation import (  # noqa: E402
    quantize_heads,
    rms_norm_quant,
    rms_norm_quant_reference,
    silu_mul_quant,
    silu_mul_quant_reference,
)
from starshard.kernels.fp8 import E4M3_MAX, FP8_DTYPE, dequantize, fp8_linear_reference, quantize_rows  # noqa: E402
from starshard.parallel import fp8 as fp8_module  # noqa: E402
from starshard.parallel.fp8 import DeferredRMSNorm, Fp8Linear, fuse_inputs, quantize_linears  # noqa: E402
from starshard.presets import PRESETS  # noqa: E402

LOOP = dict(block=64, warps=1)  # forces the looping kernels: rows span several tiles, the last partial


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def check_quantized(q32, scale, exact, ref8, ref_scale):
    """q32: a kernel's values before the cast. Against float64 (`exact`): every row's amax maps to 448 and
    each value is within e4m3's rounding (3 mantissa bits, subnormal step 2^-9 of the scale) plus the
    input dtype's one rounding; against the torch reference: the same scales and e4m3 bytes."""
    q8 = q32.to(FP8_DTYPE)
    back = dequantize(q8, scale, torch.float64)
    amax = exact.abs().amax(-1)
    nonzero = amax > 0
    assert torch.isfinite(scale).all() and (back[~nonzero] == 0).all()
    assert torch.allclose(scale.double()[nonzero], amax[nonzero] / E4M3_MAX, rtol=2e-3)
    bound = (torch.maximum(exact.abs() * 2**-4, scale.double()[:, None] * 2**-10) + exact.abs() * 2**-10) * (1 + 1e-6)
    assert ((back - exact).abs() <= bound).all()
    assert (q8.float().abs().amax(-1)[nonzero] == E4M3_MAX).all()
    assert torch.allclose(scale, ref_scale, rtol=1e-6, atol=0)
    assert (q8.view(torch.uint8) != ref8.view(torch.uint8)).float().mean() < 1e-3  # at most a last-bit tie apart


# ---------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,K,tile", [(7, 300, None), (5, 4096, None), (3, 200, LOOP)])
def test_rms_norm_quant_against_float64(rows, K, tile, dtype, interpret):
    g = torch.Generator().manual_seed(rows * 1000 + K)
    x = (3 * torch.randn(rows, K, generator=g) * torch.logspace(-2, 1, K)).to(dtype)
    x[1] = 0  # an all-zero row: finite scale, zeros out
    w = (torch.rand(K, generator=g) + 0.5).to(dtype)
    eps = 1e-5
    q32, s = rms_norm_quant(x, w, eps, out_dtype=torch.float32, tile=tile)
    assert q32.shape == (rows, K) and s.shape == (rows,) and s.dtype == torch.float32
    xd = x.double()
    exact = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    check_quantized(q32, s, exact, *rms_norm_quant_reference(x, w, eps))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,F,tile", [(9, 150, None), (3, 200, LOOP)])
def test_silu_mul_quant_against_float64(rows, F, tile, dtype, interpret):
    g = torch.Generator().manual_seed(rows * 100 + F)
    gate_up = (4 * torch.randn(2, rows, 2 * F, generator=g)).to(dtype)  # leading dims are flattened
    gate_up[1, 2] = 0
    q32, s = silu_mul_quant(gate_up, out_dtype=torch.float32, tile=tile)
    assert q32.shape == (2 * rows, F) and s.shape == (2 * rows,)
    gate, up = gate_up.double().reshape(-1, 2 * F).chunk(2, -1)
    exact = gate * torch.sigmoid(gate) * up
    check_quantized(q32, s, exact, *silu_mul_quant_reference(gate_up.reshape(-1, 2 * F)))


def _heads_layouts(B, H, L, D, dtype, g):
    """Attention's output [B, H, L, D] as it may lie: contiguous, as a transposed [B, L, H, D] tensor, and
    a slice of a wider tensor (strides that are neither)."""
    base = 3 * torch.randn(B, H, L, D, generator=g) * torch.logspace(-2, 1, D)
    base[0, :, 1] = 0  # an all-zero row (every head of one position): finite scale, zeros out
    return {
        "contiguous": base.to(dtype),
        "from [B, L, H, D]": base.transpose(1, 2).contiguous().to(dtype).transpose(1, 2),
        "sliced": torch.cat([base, base[..., :3]], -1).to(dtype)[..., :D],
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("B,H,L,D,block_l", [(1, 4, 37, 64, 16), (2, 3, 5, 80, 4), (2, 2, 33, 16, 8)])
@pytest.mark.parametrize("one_tile", [True, False])
def test_quantize_heads_against_float64(B, H, L, D, block_l, one_tile, dtype, interpret):
    """quantize_heads(o) = quantize_rows of o's rows [B * L, H * D] for any layout of o (odd lengths, head
    counts and widths that are not powers of two, partial position blocks), both kernel layouts (all heads
    in registers / a loop over heads), against float64."""
    g = torch.Generator().manual_seed(B * 1000 + L)
    for name, o in _heads_layouts(B, H, L, D, dtype, g).items():
        q32, s = quantize_heads(o, out_dtype=torch.float32, tile=dict(block_l=block_l, warps=2, one_tile=one_tile))
        assert q32.shape == (B * L, H * D) and s.shape == (B * L,) and s.dtype == torch.float32, name
        rows = o.transpose(1, 2).reshape(B * L, H * D)
        check_quantized(q32, s, rows.double(), *quantize_rows(rows))


def test_quantize_heads_default_tile(interpret):
    """The default tile: all heads of a few positions in registers for Llama's 32 x 128, a loop past
    ONE_TILE_MAX values a row; the call without a tile equals the looping one."""
    assert activation.heads_tile(32, 128) == dict(block_l=4, warps=8, one_tile=True)
    assert not activation.heads_tile(256, 128)["one_tile"]
    o = torch.randn(1, 3, 9, 24, generator=torch.Generator().manual_seed(4))
    got, want = quantize_heads(o, out_dtype=torch.float32), quantize_heads(o, out_dtype=torch.float32, tile=LOOP_HEADS)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


LOOP_HEADS = dict(block_l=4, warps=1, one_tile=False)


def test_quantize_heads_refuses_other_shapes():
    with pytest.raises(ValueError, match=r"attention's output \[B, H, L, D\]"):
        quantize_heads(torch.zeros(4, 64))


def test_silu_mul_quant_refuses_odd_width():
    with pytest.raises(ValueError, match="odd width"):
        silu_mul_quant(torch.zeros(2, 5))


def test_fused_quant_only_for_cuda_prefill_rows():
    assert not activation.use_fused_quant(torch.zeros(100, 64))  # CPU: the torch path, unchanged numerics


# ---------------------------------------------------------------------------- Fp8Linear's fused branch
def _torch_cast(kernel):
    """The kernel with torch's e4m3 conversion in place of the interpreter's (module docstring)."""
    def run(*args, **kw):
        q32, s = kernel(*args, out_dtype=torch.float32, **kw)
        return q32.to(FP8_DTYPE), s
    return run


def _scaled_mm_reference(x8, sx, w8, ws, bias, out_dtype):
    """torch._scaled_mm's math (CUDA only) on the CPU: float64 products of the dequantized operands."""
    y = dequantize(x8, sx, torch.float64) @ dequantize(w8, ws, torch.float64).t()
    return (y if bias is None else y + bias.double()).to(out_dtype)


@pytest.mark.parametrize("transform", ["norm", "silu_mul"])
def test_fp8_linear_fused_branch(transform, interpret, monkeypatch):
    """Fp8Linear.forward on a prefill-sized input takes the fused branch (forced here: it is CUDA-only),
    which runs the interpreted kernel and the FP8 GEMM on its output; equal to the unfused reference:
    the transform as torch ops, then quantize_rows and the dequantized product."""
    monkeypatch.setattr(fp8_module, "use_fused_quant", lambda x: True)
    gemms = []
    monkeypatch.setattr(fp8_module, "scaled_mm", lambda *a: gemms.append(a[0]) or _scaled_mm_reference(*a))
    monkeypatch.setattr(fp8_module, "rms_norm_quant", _torch_cast(rms_norm_quant))
    monkeypatch.setattr(fp8_module, "silu_mul_quant", _torch_cast(silu_mul_quant))
    g = torch.Generator().manual_seed(7)
    K, N, rows = 96, 40, 67
    lin = Fp8Linear.quantize(torch.nn.Linear(K, N).requires_grad_(False))
    if transform == "norm":
        norm = RMSNorm(K, 1e-6).requires_grad_(False)
        norm.weight.copy_(torch.rand(K, generator=g) + 0.5)
        lin.fuse_norm(DeferredRMSNorm.of(norm))
        x = torch.randn(1, rows, K, generator=g) * 2
        before = norm(x)
    else:
        lin.input_act = "silu_mul"
        x = torch.randn(1, rows, 2 * K, generator=g) * 2
        gate, up = x.chunk(2, -1)
        before = torch.nn.functional.silu(gate) * up
    y = lin(x)
    want = fp8_linear_reference(before, lin.weight, lin.weight_scale, lin.bias, quantize_input=True)
    assert len(gemms) == 1 and gemms[0].dtype == FP8_DTYPE and gemms[0].shape == (rows, K)  # the fused branch ran
    assert y.shape == (1, rows, N) and rel(y, want) < 1e-5
    # the activations were rounded through e4m3 (the test would see a missing quantization)
    assert rel(y, fp8_linear_reference(before, lin.weight, lin.weight_scale, lin.bias)) > 1e-4


@pytest.mark.parametrize("fused", [True, False])
def test_fp8_linear_forward_heads(fused, interpret, monkeypatch):
    """project_heads(wo, o, residual) with an Fp8Linear: prefill-sized inputs (forced here: the branch is
    CUDA-only) quantize o from the heads' layout and run one FP8 GEMM; the rest take the transposing copy.
    Both equal the reference on the copied rows (rounded through e4m3 as prefill rows are), + residual; a plain
    Linear takes the copy."""
    monkeypatch.setattr(fp8_module, "use_fused_quant", lambda x, width=None: fused)
    gemms = []
    monkeypatch.setattr(fp8_module, "scaled_mm", lambda *a: gemms.append(a[0]) or _scaled_mm_reference(*a))
    monkeypatch.setattr(fp8_module, "quantize_heads", _torch_cast(quantize_heads))
    g = torch.Generator().manual_seed(8)
    B, H, L, D, N = 2, 3, 67, 32, 40
    lin = Fp8Linear.quantize(torch.nn.Linear(H * D, N).requires_grad_(False))
    o = (torch.randn(B, L, H, D, generator=g) * 2).transpose(1, 2)  # a view, as attention may return
    residual = torch.randn(B, L, N, generator=g)
    y = project_heads(lin, o, residual)
    rows = o.transpose(1, 2).reshape(B, L, H * D)
    want = fp8_linear_reference(rows, lin.weight, lin.weight_scale, lin.bias, quantize_input=True) + residual
    assert len(gemms) == int(fused) and y.shape == (B, L, N) and rel(y, want) < 1e-5
    if fused:
        assert gemms[0].dtype == FP8_DTYPE and gemms[0].shape == (B * L, H * D)
    plain = Linear(H * D, N).requires_grad_(False)
    assert torch.equal(project_heads(plain, o, residual), plain(rows) + residual)


# ---------------------------------------------------------------------------- the model
def _quantized(cfg: ModelConfig, dtype=torch.float32) -> Transformer:
    torch.manual_seed(0)
    m = Transformer(cfg).to(dtype).eval().requires_grad_(False)
    for block in m.layers:  # norms away from 1, so a lost norm weight shows
        block.attention_norm.weight.uniform_(0.5, 1.5)
        block.ffn_norm.weight.uniform_(0.5, 1.5)
        experts = getattr(block.feed_forward, "experts", None)
        if experts is not None:  # stacked expert weights are allocated empty (the loader fills them)
            experts.w13.normal_(0, 0.1)
            experts.w2.normal_(0, 0.1)
    return quantize_linears(m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fuse_inputs_keeps_cpu_logits(dtype):
    """fuse_inputs moves the norms and the silu-mul into the FP8 projections: on the CPU the logits are
    bit-identical to the model before the move, for prefill-sized (e4m3 activations) and decode-sized
    calls; the state dict keeps its names; a second call changes nothing."""
    m = _quantized(ModelConfig.from_hf(PRESETS["tiny"]), dtype)
    ids = torch.randint(0, m.config.vocab_size, (1, 80), generator=torch.Generator().manual_seed(1))
    want_prefill, want_decode = m(ids), m(ids[:, :3])
    keys = set(m.state_dict())
    fuse_inputs(m)
    block = m.layers[0]
    assert isinstance(block.attention_norm, DeferredRMSNorm) and block.attention.wqkv.input_norm is block.attention_norm
    assert block.feed_forward.w13.input_norm is block.ffn_norm and block.feed_forward.w2.input_act == "silu_mul"
    assert isinstance(block.feed_forward.act, torch.nn.Identity)
    assert set(m.state_dict()) == keys
    assert torch.equal(m(ids), want_prefill) and torch.equal(m(ids[:, :3]), want_decode)
    fuse_inputs(m)
    assert m.layers[0].attention.wqkv.input_norm is m.layers[0].attention_norm
    assert torch.equal(m(ids), want_prefill)


def test_fuse_inputs_on_meta_then_load():
    """The FP8 checkpoint path: the meta model is quantized and fused before its weights are assigned
    (load_state_dict(assign=True) replaces the norm's Parameter); the projection reads the loaded one."""
    cfg = ModelConfig.from_hf(PRESETS["tiny"])
    src = _quantized(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 70), generator=torch.Generator().manual_seed(2))
    want = src(ids)
    with torch.device("meta"):
        m = Transformer(cfg)
    fuse_inputs(quantize_linears(m))
    m.load_state_dict(src.state_dict(), assign=True)
    m.inv_freq = src.inv_freq
    assert torch.equal(m(ids), want)


def test_moe_layers_keep_ffn_norm():
    """MoE layers: attention_norm moves into wqkv; ffn_norm stays (the router and the experts read it)."""
    cfg = ModelConfig.from_hf({**PRESETS["tiny-moe"], "mlp_only_layers": [0]})
    m = _quantized(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 70), generator=torch.Generator().manual_seed(3))
    want = m(ids)
    fuse_inputs(m)
    dense, moe = m.layers
    assert isinstance(dense.feed_forward, FeedForward) and isinstance(dense.ffn_norm, DeferredRMSNorm)
    assert type(moe.ffn_norm) is RMSNorm and isinstance(moe.attention_norm, DeferredRMSNorm)
    assert torch.equal(m(ids), want)
