"""--fp8 experts: an MoE model's experts in e4m3 with one float32 scale per expert row (parallel/fp8.py
Fp8GroupedExperts). CPU: the reference path (dequantize, then the grouped GEMM) against the 16-bit model and
against the GPU's FP8 grouped-GEMM branch (its GEMM replaced by a float64 one);
the decode kernels (Triton interpreter) against that path; tp=2 on gloo against one process; the planner's
and the MoE bench's bytes; the refusals."""
import pytest
import torch

from tests.helpers.hf_models import make_hf_model
from tests.helpers.mp_harness import run_ranks
from starshard import LLM
from starshard import llm as llm_module
from starshard.benchmarks.moe import decode_bytes
from starshard.checkpoints.convert import fp8_parts
from starshard.config import Fp8Config, ModelConfig, ParallelConfig
from starshard.engine import moe as moe_module
from starshard.engine.moe import MoEFeedForward, grouped_experts, route
from starshard.kernels import activation
from starshard.kernels.fp8 import FAST_ACCUM, FP8_DTYPE, dequantize, quantize_rows
from starshard.kernels.moe_decode import GEMV_MAX_PAIRS
from starshard.parallel.fp8 import Fp8GroupedExperts, quantize_experts
from starshard.parallel.topology import LayoutError
from starshard.planner import Layout, Workload, plan_memory
from starshard.presets import preset_config

IDS = [5, 17, 42, 99, 3, 250, 77, 8, 301, 12, 64, 7]


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _logits(llm):
    with torch.inference_mode():
        return llm.model(torch.tensor([IDS]))[0].float()


def test_e4m3_experts_close_to_the_16bit_model():
    base = LLM(random_weights="tiny-moe", dtype=torch.float32, progress=False)
    fp8 = LLM(random_weights="tiny-moe", dtype=torch.float32, progress=False, fp8="experts")
    for layer in fp8.model.layers:
        ex = layer.feed_forward.experts
        assert isinstance(ex, Fp8GroupedExperts) and ex.w13.dtype == FP8_DTYPE and ex.w2.dtype == FP8_DTYPE
        assert ex.w13_scale.shape == ex.w13.shape[:2] and ex.w2_scale.shape == ex.w2.shape[:2]
        assert layer.feed_forward.router.weight.dtype == torch.float32  # the router stays
    assert not any(p.dtype == FP8_DTYPE for p in base.model.parameters())
    err = rel(_logits(fp8), _logits(base))
    assert 0 < err < 0.05, err  # e4m3 rounding of the experts only: a few % at most
    assert fp8.generate(IDS, max_new_tokens=4).token_ids  # decode runs through it


def _moe_layer(seed=0):
    cfg = ModelConfig(arch="qwen3_moe", vocab_size=32, hidden_size=48, intermediate_size=64, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=12, num_experts=16, num_experts_per_tok=4,
                      moe_intermediate_size=24, norm_topk_prob=True)
    moe = MoEFeedForward(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        moe.router.weight.copy_(torch.randn(16, 48, generator=g) * 0.5)
        moe.experts.w13.copy_(torch.randn(16, 48, 48, generator=g) * 0.2)
        moe.experts.w2.copy_(torch.randn(16, 48, 24, generator=g) * 0.2)
    return moe


def test_decode_kernels_read_the_e4m3_experts(monkeypatch):
    """The decode kernels (interpreter, forced on the CPU) on the e4m3 rows and scales against the torch path
    on the dequantized weights; the residual still goes into the down kernel."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    moe = _moe_layer()
    moe.experts = Fp8GroupedExperts.quantize(moe.experts)
    x = torch.randn(3, 1, 48, generator=torch.Generator().manual_seed(1))
    r = torch.randn(3, 1, 48, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = moe(x, residual=r)
        moe.decode_kernels = True
        got = moe(x, residual=r)
    assert rel(got, want) <= 1e-6


def test_prefill_sized_calls_round_their_inputs_as_the_fp8_gemms():
    """Past GEMV_MAX_PAIRS (token, expert) pairs the reference path (the CPU) rounds the gathered rows and
    silu(gate) * up per row through e4m3, as the GPU's FP8 grouped GEMMs take them; below, only the weights
    are e4m3 (as the decode kernels). Checked against a float64 loop over the pairs."""
    moe = _moe_layer()
    moe.experts = Fp8GroupedExperts.quantize(moe.experts)
    ex = moe.experts
    w13, w2 = dequantize(ex.w13, ex.w13_scale, torch.float64), dequantize(ex.w2, ex.w2_scale, torch.float64)

    def rounded(t):
        return dequantize(*quantize_rows(t), torch.float64)

    for T in (5, 40):  # 20 and 160 pairs (k = 4)
        x = torch.randn(T, 48, generator=torch.Generator().manual_seed(T))
        with torch.no_grad():
            weights, experts = route(moe.router(x), 4, True)
            got = grouped_experts(x, weights, experts, ex.w13, ex.w2, w13_scale=ex.w13_scale, w2_scale=ex.w2_scale)
        quantized = T * 4 > GEMV_MAX_PAIRS
        want = torch.zeros(T, 48, dtype=torch.float64)
        for t in range(T):
            xt = rounded(x[t:t + 1].float())[0] if quantized else x[t].double()
            for wj, ej in zip(weights[t].double(), experts[t]):
                h = w13[ej] @ xt
                a = torch.nn.functional.silu(h[:24]) * h[24:]
                want[t] += wj * (w2[ej] @ (rounded(a[None].float())[0] if quantized else a))
        assert rel(got, want) <= 1e-5, (T, rel(got, want))


def test_grouped_fp8_branch_wiring(monkeypatch):
    """The GPU's FP8 grouped-GEMM branch ("grouped_fp8") run on the CPU: torch._scaled_grouped_mm replaced by a
    float64 product of the dequantized operands (which also checks it is asked for fast accumulation, as the
    dense FP8 GEMM), silu_mul_quant by the interpreter with torch's e4m3 cast. Equal to the reference path
    (rows and silu-mul rounded per row, dequantized weights): the gather, the group offsets and the scales
    reach the GEMMs as the GPU gets them."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    asked = []

    def scaled_grouped_mm(a8, b_t, sa, sb, offs, out_dtype, use_fast_accum):
        asked.append(use_fast_accum)
        a = dequantize(a8, sa, torch.float64)
        out = torch.empty(a.shape[0], b_t.shape[-1], dtype=torch.float64)
        start = 0
        for e, end in enumerate(offs.tolist()):
            w = dequantize(b_t[e].t().contiguous(), sb[e], torch.float64)  # [N, K] rows with their scales
            out[start:end] = a[start:end] @ w.t()
            start = end
        return out.to(out_dtype)

    def silu_mul_quant_torch_cast(gate_up):
        q32, s = activation.silu_mul_quant(gate_up, out_dtype=torch.float32)
        return q32.to(FP8_DTYPE), s

    monkeypatch.setattr(moe_module, "_SCALED_GROUPED_MM", scaled_grouped_mm)
    monkeypatch.setattr(moe_module, "silu_mul_quant", silu_mul_quant_torch_cast)
    moe = _moe_layer(seed=3)
    ex = Fp8GroupedExperts.quantize(moe.experts)
    x = torch.randn(40, 48, generator=torch.Generator().manual_seed(4))  # 160 pairs: past GEMV_MAX_PAIRS
    with torch.no_grad():
        weights, experts = route(moe.router(x), 4, True)
        got = grouped_experts(x, weights, experts, ex.w13, ex.w2, impl="grouped_fp8", w13_scale=ex.w13_scale,
                              w2_scale=ex.w2_scale)
        want = grouped_experts(x, weights, experts, ex.w13, ex.w2, impl="grouped", w13_scale=ex.w13_scale,
                               w2_scale=ex.w2_scale)
    assert asked == [FAST_ACCUM, FAST_ACCUM]
    assert rel(got, want) <= 1e-5, rel(got, want)


def test_quantize_experts_swaps_moe_layers_once():
    llm = LLM(random_weights="tiny-moe", dtype=torch.float32, progress=False)
    assert quantize_experts(llm.model) == 2 and quantize_experts(llm.model) == 0
    dense = LLM(random_weights="tiny", dtype=torch.float32, progress=False)
    assert quantize_experts(dense.model) == 0


def test_a_dense_model_refuses_fp8_experts(tmp_path, monkeypatch):
    with pytest.raises(LayoutError, match="no MoE layers.*drop `experts`"):
        LLM(random_weights="tiny", dtype=torch.float32, progress=False, fp8="experts")
    _, path = make_hf_model("llama", tmp_path)
    monkeypatch.setattr(llm_module, "load_model", lambda *a, **k: pytest.fail("weights loaded before the refusal"))
    with pytest.raises(LayoutError, match="llama has no MoE layers"):
        LLM(path, dtype=torch.float32, progress=False, fp8="experts")


def test_the_converter_refuses_fp8_experts():
    with pytest.raises(ValueError, match="experts are quantized as they load"):
        fp8_parts("linear,experts")
    assert Fp8Config.parse("linear,experts") == Fp8Config(linear=True, experts=True)


def _tp_rank(rank, world):
    from starshard.parallel.tensor import gather_logits

    llm = LLM(random_weights="tiny-moe", dtype=torch.float32, progress=False, parallel=ParallelConfig(tp=2),
              fp8="experts")
    ex = llm.model.layers[0].feed_forward.experts
    with torch.inference_mode():
        local = llm.model(torch.tensor([IDS]), last_only=True)[0, -1]
    return {"logits": gather_logits(local[None], llm.runner.sampler.vocab)[0], "fp8": isinstance(ex, Fp8GroupedExperts),
            "width": ex.w13.shape[1]}


def test_fp8_experts_tensor_parallel():
    """tp=2: each rank quantizes its half of every expert's width (w2's rows get this rank's scales); the
    logits stay close to one process with --fp8 experts."""
    one = LLM(random_weights="tiny-moe", dtype=torch.float32, progress=False, fp8="experts")
    ref = _logits(one)[-1]
    for r in run_ranks(_tp_rank, 2):
        assert r["fp8"] and r["width"] == 2 * 32 // 2
        assert rel(r["logits"], ref) < 0.03


def test_planner_and_bench_count_e4m3_experts():
    cfg = preset_config("qwen3-30b-a3b")
    L, E, k, h, fe = cfg.num_layers, cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    bf16 = plan_memory(cfg, Layout(), Workload(4096)).worst
    fp8 = plan_memory(cfg, Layout(), Workload(4096, fp8_experts=True)).worst
    assert bf16.weights - fp8.weights == L * E * (3 * fe * h - (2 * fe + h) * 4)
    assert fp8.activations - bf16.activations == E * 3 * fe * h * (4 + 2)  # one layer dequantized for prefill
    plain, e4m3 = decode_bytes(cfg, 4096, 2), decode_bytes(cfg, 4096, 2, Fp8Config(experts=True))
    assert plain["kv"] == e4m3["kv"] and plain["weights"] - e4m3["weights"] == L * k * (3 * fe * h - (2 * fe + h) * 4)
