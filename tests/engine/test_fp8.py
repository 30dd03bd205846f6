"""FP8 (issue 19): e4m3 numerics against float64, the FP8 linear's reference path, the FP8 KV cache
through every context strategy (gloo) against the same run with a float32 cache, and the errors
for bad --fp8 values and GPUs without FP8."""
import argparse

import pytest
import torch
from tests.helpers.hf_models import make_hf_model
from tests.helpers.mp_harness import run_ranks

from starshard import LLM
from starshard.cli import add_fp8_arguments, add_layout_arguments, add_sparse_arguments, fp8_config, layout_error
from starshard.config import Fp8Config, ModelConfig, ParallelConfig
from starshard.engine.kv_cache import LayerKV
from starshard.kernels import fp8 as fp8_kernels
from starshard.kernels.attention import attention
from starshard.kernels.decode import decode_attention
from starshard.kernels.sparse import SparseConfig
from starshard.kernels.fp8 import (
    E4M3_MAX,
    FP8_DTYPE,
    dequantize,
    fp8_linear,
    quantize_rows,
)
from starshard.parallel.fp8 import Fp8Linear, quantize_linears
from starshard.parallel.topology import LayoutError
from starshard.planner import Layout, Workload, plan_memory
from starshard.presets import PRESETS

STEPS = 12


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ---------------------------------------------------------------------------- numerics
def test_quantize_rows_against_float64():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 3, 80, generator=g, dtype=torch.float64) * torch.logspace(-3, 3, 80, dtype=torch.float64)
    x[5, 1] = 0  # an all-zero row: scale stays finite, values stay 0
    x8, s = quantize_rows(x)
    assert x8.dtype == FP8_DTYPE and s.dtype == torch.float32 and s.shape == x.shape[:-1]
    amax = x.abs().amax(-1)
    nonzero = amax > 0
    assert torch.allclose(s.double()[nonzero], amax[nonzero] / E4M3_MAX, rtol=1e-6)
    back = dequantize(x8, s, torch.float64)
    assert torch.isfinite(back).all() and (back[5, 1] == 0).all()
    # e4m3: 3 mantissa bits (relative error <= 2^-4 for normals), subnormal step 2^-9 of the scale
    bound = torch.maximum(x.abs() * 2**-4, s.double()[..., None] * 2**-10) * (1 + 1e-6)
    assert ((back - x).abs() <= bound).all()
    # every row's largest magnitude maps to 448, nothing beyond
    assert (x8.float().abs().amax(-1)[nonzero] == E4M3_MAX).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dequantize_kernel_gives_the_torch_bits(monkeypatch, dtype):
    """dequantize's one-pass Triton kernel (contiguous e4m3 on CUDA; the interpreter here) stores the torch
    path's bits: the same float32 product, one rounding; rows wider than one block (2500 > 2048)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(5)
    x8, s = quantize_rows(torch.randn(4, 3, 2500, generator=g) * 7)
    got = fp8_kernels.dequantize_rows_cuda(x8, s, dtype)
    assert got.dtype == dtype and got.shape == x8.shape
    assert torch.equal(got, dequantize(x8, s, dtype))


def test_fp8_linear_reference_against_float64():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 72, generator=g) / 72**0.5
    b = torch.randn(48, generator=g)
    x = torch.randn(5, 9, 72, generator=g)
    w8, ws = quantize_rows(w)
    y = fp8_linear(x, w8, ws, b)
    exact = x.double() @ dequantize(w8, ws, torch.float64).t() + b.double()
    assert y.shape == (5, 9, 48) and rel(y, exact) < 1e-6  # the reference path: dequantize, then matmul
    assert rel(y, x.double() @ w.double().t() + b.double()) < 0.05  # e4m3 weights: a few % at most
    # more rows than the decode kernel takes: the FP8 GEMM's numerics, activations rounded per row too
    xl = torch.randn(70, 72, generator=g) * torch.logspace(-2, 1, 72)
    yl = fp8_linear(xl, w8, ws, b)
    assert rel(yl, dequantize(*quantize_rows(xl), torch.float64) @ dequantize(w8, ws, torch.float64).t()
               + b.double()) < 1e-6
    assert rel(yl, xl.double() @ dequantize(w8, ws, torch.float64).t() + b.double()) > 1e-4  # x was rounded
    lin = Fp8Linear.quantize(torch.nn.Linear(72, 48).requires_grad_(False))
    assert lin.weight.dtype == FP8_DTYPE and lin(x).shape == (5, 9, 48)


def test_scaled_mm_asks_for_fast_accumulation(monkeypatch):
    """The prefill GEMM runs with the tensor cores' own accumulation unless STARSHARD_FP8_FAST_ACCUM=0
    (measured: docs/results.md, FP8); the op itself is CUDA-only, so it is faked."""
    seen = {}

    def fake(a, b, *, scale_a, scale_b, out_dtype, use_fast_accum):
        seen.update(shapes=(a.shape, b.shape, scale_a.shape, scale_b.shape), fast=use_fast_accum)
        return torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", fake)
    x8, sx = quantize_rows(torch.randn(70, 32))
    w8, sw = quantize_rows(torch.randn(16, 32))
    y = fp8_kernels.scaled_mm(x8, sx, w8, sw, torch.ones(16, dtype=torch.bfloat16), torch.bfloat16)
    assert seen == dict(shapes=((70, 32), (32, 16), (70, 1), (1, 16)), fast=True) and fp8_kernels.FAST_ACCUM
    assert y.dtype == torch.bfloat16 and torch.equal(y, torch.ones(70, 16, dtype=torch.bfloat16))
    monkeypatch.setattr(fp8_kernels, "FAST_ACCUM", False)
    fp8_kernels.scaled_mm(x8, sx, w8, sw, None, torch.bfloat16)
    assert seen["fast"] is False


@pytest.mark.parametrize("M", [1, 3])
def test_weight_only_gemv_against_float64(M, monkeypatch):
    """The decode GEMV kernel (up to GEMV_MAX_ROWS rows), interpreted on the CPU: odd N and K, a bias.
    (The tensor-core tile kernel for more rows is autotuned, which the interpreter cannot run; it is
    checked on the GPU by bench/fp8_probe.py.)"""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from starshard.kernels.fp8 import GEMV_MAX_ROWS, weight_only_linear

    g = torch.Generator().manual_seed(M)
    N, K = 37, 200
    w8, ws = quantize_rows(torch.randn(N, K, generator=g) / K**0.5)
    x, b = torch.randn(M, K, generator=g), torch.randn(N, generator=g)
    tile = dict(block_n=8, block_k=64, warps=1)  # K spans several tiles, the last one partial
    y = weight_only_linear(x, w8, ws, b, gemv_tile=tile)
    want = x.double() @ dequantize(w8, ws, torch.float64).t() + b.double()
    assert M <= GEMV_MAX_ROWS
    assert y.shape == (M, N) and rel(y, want) < 1e-5


@pytest.mark.parametrize("M", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_weight_only_gemv_adds_the_residual_as_torch_does(M, dtype, monkeypatch):
    """residual= (the block's residual add in the GEMV's epilogue), interpreted on the CPU: equal to
    weight_only_linear(x) + residual, i.e. the product rounded to x's dtype first, then the sum; with a
    strided residual and a bias."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from starshard.kernels.fp8 import weight_only_linear

    g = torch.Generator().manual_seed(10 + M)
    N, K = 45, 130
    w8, ws = quantize_rows(torch.randn(N, K, generator=g) / K**0.5)
    x, b = torch.randn(M, K, generator=g).to(dtype), torch.randn(N, generator=g).to(dtype)
    res = (100 * torch.randn(M, 2 * N, generator=g)).to(dtype)[:, ::2]  # large: the sum's rounding shows
    tile = dict(block_n=8, block_k=64, warps=1)
    plain = weight_only_linear(x, w8, ws, b, gemv_tile=tile)
    fused = weight_only_linear(x, w8, ws, b, gemv_tile=tile, residual=res)
    assert fused.dtype == dtype and torch.equal(fused, plain + res)


def test_fp8_linear_residual_on_cpu_and_the_block_sum():
    """fp8_linear(residual=) and Fp8Linear(x, residual=) give linear(x) + residual on the CPU (the
    reference path), also row-parallel style (the residual after the bias), and the engine's blocks route
    their residual sums through project_add: a model's output is unchanged by it."""
    from starshard.engine.model import project_add

    g = torch.Generator().manual_seed(4)
    lin = Fp8Linear.quantize(torch.nn.Linear(64, 48).requires_grad_(False))
    x, r = torch.randn(2, 3, 64, generator=g), torch.randn(2, 3, 48, generator=g)
    assert torch.equal(lin(x, residual=r), lin(x) + r)
    assert torch.equal(fp8_linear(x, lin.weight, lin.weight_scale, lin.bias, residual=r), lin(x) + r)
    assert torch.equal(project_add(lin, x, r), lin(x) + r)
    plain = torch.nn.Linear(64, 48)
    assert torch.equal(project_add(plain, x, r), plain(x) + r) and torch.equal(project_add(plain, x, None), plain(x))


def test_weight_only_gemv_default_tiles(monkeypatch):
    """The tile chosen by weight shape (kernels/fp8.py gemv_tile_for): each class of the sweep, and the
    long-row tile run (interpreted) over a K that ends in a partial 2048 tile, against float64."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from starshard.kernels.fp8 import GEMV_LONG_ROWS, GEMV_MANY_ROWS, GEMV_OTHER, gemv_tile_for, weight_only_linear

    assert gemv_tile_for(4096, 14336) is GEMV_LONG_ROWS and gemv_tile_for(28672, 4096) is GEMV_MANY_ROWS
    assert gemv_tile_for(6144, 4096) is GEMV_MANY_ROWS and gemv_tile_for(4096, 4096) is GEMV_OTHER
    g = torch.Generator().manual_seed(5)
    N, K = 6, 8195
    w8, ws = quantize_rows(torch.randn(N, K, generator=g) / K**0.5)
    x = torch.randn(1, K, generator=g)
    y = weight_only_linear(x, w8, ws)
    assert rel(y, x.double() @ dequantize(w8, ws, torch.float64).t()) < 1e-5


def test_fp8_kv_cache_store_and_read():
    g = torch.Generator().manual_seed(2)
    kv = LayerKV(1, 2, 16, 4, torch.float32, "cpu", fp8=True)
    k1, v1 = torch.randn(1, 2, 3, 16, generator=g), torch.randn(1, 2, 3, 16, generator=g)
    k, v, pos = kv.append(k1, v1, torch.arange(3))
    assert k is k1 and v is v1  # a prefill attends its own keys as computed
    k2, v2 = torch.randn(1, 2, 5, 16, generator=g) * 10, torch.randn(1, 2, 5, 16, generator=g)
    k, v, pos = kv.append(k2, v2, torch.arange(3, 8))  # grows past capacity 4
    assert kv.capacity >= 8 and pos.tolist() == list(range(8))
    assert torch.equal(k[:, :, 3:], k2) and rel(k[:, :, :3], k1) < 0.05  # held entries come back dequantized
    s = kv.stored()
    assert s.k.dtype == FP8_DTYPE and s.k_scale.shape == (1, 2, 8)
    # an entry's bytes depend on that key alone (same bytes whatever else was written with it)
    k8, ks = quantize_rows(k2)
    assert torch.equal(s.k[:, :, 3:].view(torch.uint8), k8.view(torch.uint8)) and torch.equal(s.k_scale[:, :, 3:], ks)
    assert kv.nbytes() == 2 * (2 * 8 * 16 * 1 + 2 * 8 * 4) + 8 * 8  # e4m3 k, v + float32 scales + positions


@pytest.mark.parametrize("use_triton,dtype", [(False, torch.float32), (True, torch.float32), (True, torch.float16)])
def test_attention_reads_fp8_cache(use_triton, dtype, monkeypatch):
    """attention / decode_attention over e4m3 k, v with per-(head, key) scales equal float64 attention over
    the dequantized cache (the Triton kernel under the interpreter in float32, and in fp16, where the
    kernel multiplies in fp16: values of 1e-3 give scales whose products with the probabilities fall
    below fp16's normal range unless the kernel factors the block's scale out)."""
    if use_triton:
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(3)
    B, Hq, Hkv, Lq, Lk, D = 1, 6, 2, 3, 77, 16
    q = torch.randn(B, Hq, Lq, D, generator=g).to(dtype)
    k, v = torch.randn(B, Hkv, Lk, D, generator=g), torch.randn(B, Hkv, Lk, D, generator=g)
    if dtype == torch.float16:
        v = v * 1e-3
    k8, ks = quantize_rows(k)
    v8, vs = quantize_rows(v)
    kp, qp = torch.arange(Lk), torch.tensor([40, 60, 76])
    kd, vd = dequantize(k8, ks, torch.float64), dequantize(v8, vs, torch.float64)
    ref, ref_lse = attention(q.double(), kd, vd, q_pos=qp, k_pos=kp, causal=True)
    if use_triton:
        out, lse = decode_attention(q, k8, v8, q_pos=qp, k_pos=kp, causal=True, k_scale=ks, v_scale=vs, use_triton=True)
    else:
        out, lse = attention(q, k8, v8, q_pos=qp, k_pos=kp, causal=True, k_scale=ks, v_scale=vs)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert rel(out, ref) < tol and (lse.double() - ref_lse).abs().max() < 1e2 * tol


# ---------------------------------------------------------------------------- through the engine
def _model(tmp_path):
    _, path = make_hf_model("llama", tmp_path, num_attention_heads=8, num_key_value_heads=2, hidden_size=64,
                            eos_token_id=None)
    ids = torch.randint(0, 211, (53,), generator=torch.Generator().manual_seed(7)).tolist()
    return path, ids


def _last_logits(llm, ids):
    """Logits of the token after `ids` from a step that reads the cache: prefill all but the last token,
    then run the last one as a decode step (on the query rank; None elsewhere)."""
    runner = llm.runner
    cache = runner.new_cache(len(ids) + 2)
    with torch.inference_mode():
        if hasattr(runner, "prefill_logits"):
            runner.prefill_logits(torch.tensor(ids[:-1]), len(ids) - 2, cache)
            with runner._strategy_attention(runner.strategy.decode_attend):
                logits = runner._forward(torch.tensor([ids[-1:]]), cache=cache, last_only=True)
            return logits[0, -1] if runner.strategy.is_query_rank else None
        llm.model(torch.tensor([ids[:-1]]), cache=cache)
        return llm.model(torch.tensor([ids[-1:]]), cache=cache, last_only=True)[0, -1]


LAYOUTS = [
    {"cp_strategy": "dense"},
    {"cp": 2, "cp_strategy": "ring"},
    {"cp": 2, "cp_strategy": "ulysses"},
    {"cp": 2, "cp_strategy": "star"},
    {"cp": 2, "cp_strategy": "apb"},
]


def _strategies_rank(rank, world, path, ids):
    out = []
    for lay in LAYOUTS:
        p = ParallelConfig(**lay)
        row = {}
        for fp8 in (None, "kv"):
            llm = LLM(path, parallel=p, fp8=fp8)
            row[fp8] = {"tokens": llm.generate(ids, max_new_tokens=STEPS).token_ids, "logits": _last_logits(llm, ids),
                        "kv_dtype": llm.runner.new_cache(4).layer(llm.model.layer_ids[0]).k.dtype}
        out.append(row)
    return out


def test_fp8_kv_cache_every_strategy(tmp_path):
    """dense, ring, Ulysses, Star and APB with an e4m3 cache: the same greedy tokens as the same layout
    with a float32 cache, and logits of a step that reads the cache within a bound."""
    path, ids = _model(tmp_path)
    results = run_ranks(_strategies_rank, 2, path, ids)
    for i, lay in enumerate(LAYOUTS):
        per_rank = [r[i] for r in results]
        for r in per_rank:
            assert r["kv"]["kv_dtype"] == FP8_DTYPE and r[None]["kv_dtype"] == torch.float32, lay
            assert r["kv"]["tokens"] == r[None]["tokens"], lay
        logits = [(r["kv"]["logits"], r[None]["logits"]) for r in per_rank if r[None]["logits"] is not None]
        assert logits, lay
        for got, want in logits:
            assert 0 < rel(got, want) < 0.02, (lay, rel(got, want))


def test_fp8_linear_and_kv_one_process(tmp_path):
    """--fp8 linear (and linear,kv) on one process: projections swapped for e4m3 ones (embedding and head
    kept), logits within a bound of float32 weights."""
    path, ids = _model(tmp_path)
    ref = _last_logits(LLM(path), ids)
    for fp8 in ("linear", "linear,kv"):
        llm = LLM(path, fp8=fp8)
        att = llm.model.layers[0].attention
        assert isinstance(att.wqkv, Fp8Linear) and isinstance(llm.model.layers[0].feed_forward.w2, Fp8Linear)
        assert llm.model.output.weight.dtype == torch.float32
        assert llm.runner.kv_fp8 == (fp8 == "linear,kv")
        assert 0 < rel(_last_logits(llm, ids), ref) < 0.08, fp8


def test_fp8_attention_one_process(tmp_path, monkeypatch):
    """--fp8 attention: each layer's prefill over an empty cache takes 8-bit scores (the CPU's
    dequantize-then-attend reference of flash_fp8 variant s, once per layer), decode steps stay plain;
    logits within a bound of the float32 run, not equal to it, and the same greedy tokens."""
    import importlib

    from starshard.engine.model import dense_attend_int8_scores

    attention_mod = importlib.import_module("starshard.kernels.attention")  # the package exports a function of that name

    _, path = make_hf_model("llama", tmp_path, num_attention_heads=4, num_key_value_heads=2, hidden_size=128,
                            eos_token_id=None)  # head_dim 32: a size the kernel's tiles take
    ids = torch.randint(0, 211, (70,), generator=torch.Generator().manual_seed(8)).tolist()
    calls = []
    real = attention_mod.int8_scores_operands
    monkeypatch.setattr(attention_mod, "int8_scores_operands", lambda q, k: calls.append(q.shape) or real(q, k))
    base = LLM(path)
    for fp8 in ("attention", "linear,kv,attention"):
        llm = LLM(path, fp8=fp8)
        assert all(fn is dense_attend_int8_scores for fn in llm.model.layer_attends())
        assert llm.runner.decode_is_local()  # decode keeps the local path (CUDA graphs on a GPU)
        calls.clear()
        got, want = _last_logits(llm, ids), _last_logits(base, ids)
        assert len(calls) == len(llm.model.layers) and calls[0][2] == len(ids) - 1  # the prefill, not the step
        assert (1e-6 < rel(got, want) < 5e-3) if fp8 == "attention" else (0 < rel(got, want) < 0.08), (fp8, rel(got, want))
        if fp8 == "attention":
            assert llm.generate(ids, max_new_tokens=STEPS).token_ids == base.generate(ids, max_new_tokens=STEPS).token_ids


def _int8_rank(rank, world, path, ids, strategy):
    import importlib

    attention_mod = importlib.import_module("starshard.kernels.attention")
    calls = []
    real = attention_mod.int8_scores_operands
    attention_mod.int8_scores_operands = lambda q, k: calls.append(q.shape[2]) or real(q, k)
    row = {}
    for fp8 in (None, "attention"):
        llm = LLM(path, parallel=ParallelConfig(cp=world, cp_strategy=strategy), fp8=fp8)
        calls.clear()
        row[fp8] = {"logits": _last_logits(llm, ids), "calls": list(calls), "layers": len(llm.model.layers),
                    "tokens": llm.generate(ids, max_new_tokens=STEPS).token_ids}
    return row


@pytest.mark.parametrize("strategy", ["star", "ulysses"])
def test_fp8_attention_in_context_strategies(tmp_path, strategy):
    """--fp8 attention on 2 gloo ranks: Star's [anchor; block] context call and Ulysses' whole-sequence
    call after its all-to-all (half the heads per rank; the 89 prefilled tokens leave a padding row on
    the last shard, after every real one) take the 8-bit scores once per layer on every rank (Star's
    query phase and decode stay exact); logits within a bound of the same strategy without it, not
    equal, and the same greedy tokens."""
    _, path = make_hf_model("llama", tmp_path, num_attention_heads=4, num_key_value_heads=2, hidden_size=128,
                            eos_token_id=None)
    ids = torch.randint(0, 211, (90,), generator=torch.Generator().manual_seed(9)).tolist()
    results = run_ranks(_int8_rank, 2, path, ids, strategy)
    for rank, r in enumerate(results):
        att = r["attention"]
        assert r[None]["calls"] == [] and len(att["calls"]) == att["layers"], (rank, att["calls"])
        if strategy == "ulysses":
            assert set(att["calls"]) == {len(ids)}  # 89 prefilled + 1 padding row on each rank after the all-to-all
        assert r["attention"]["tokens"] == r[None]["tokens"]
    got, want = results[-1]["attention"]["logits"], results[-1][None]["logits"]  # the query rank's
    assert 1e-6 < rel(got, want) < 5e-3, rel(got, want)


def _tp_rank(rank, world, path, ids):
    llm = LLM(path, parallel=ParallelConfig(tp=2), fp8="linear,kv")
    wo = llm.model.layers[0].attention.wo
    return {"logits": _full_logits(llm, ids), "row_parallel": wo.reduce_group is not None,
            "tokens": llm.generate(ids, max_new_tokens=STEPS).token_ids}


def _full_logits(llm, ids):
    from starshard.parallel.tensor import gather_logits

    cache = llm.runner.new_cache(len(ids) + 1)
    with torch.inference_mode():
        local = llm.model(torch.tensor([ids]), cache=cache, last_only=True)[0, -1]
    return gather_logits(local[None], llm.runner.sampler.vocab)[0]


def test_fp8_linear_tensor_parallel(tmp_path):
    """tp=2: column-parallel shards quantized per output channel, row-parallel ones all-reduced; close to
    one process with --fp8 linear,kv (row-parallel shards have their own channel scales)."""
    path, ids = _model(tmp_path)
    one = LLM(path, fp8="linear,kv")
    with torch.inference_mode():
        ref = one.model(torch.tensor([ids]), last_only=True)[0, -1]
    results = run_ranks(_tp_rank, 2, path, ids)
    for r in results:
        assert r["row_parallel"]
        assert rel(r["logits"], ref) < 0.03


def test_quantize_linears_keeps_shapes():
    cfg = ModelConfig.from_hf(PRESETS["tiny"])
    from starshard.engine.model import Transformer

    m = Transformer(cfg)
    x = torch.randn(1, 5, cfg.hidden_size)
    w = m.layers[0].feed_forward.w13.weight.detach().clone()
    quantize_linears(m)
    ff = m.layers[0].feed_forward
    assert isinstance(ff.w13, Fp8Linear) and ff.w13.weight.shape == w.shape
    assert rel(ff.w13(x), x @ w.t()) < 0.05


# ---------------------------------------------------------------------------- flags and errors
def test_bad_fp8_values_name_the_valid_ones():
    with pytest.raises(ValueError, match="unknown item.*'fp16'.*valid: linear, kv, attention"):
        Fp8Config.parse("linear,fp16")
    assert Fp8Config.parse("linear, kv") == Fp8Config(linear=True, kv=True)
    assert Fp8Config.parse("none") == Fp8Config() == Fp8Config.parse(None)
    ap = argparse.ArgumentParser()
    add_fp8_arguments(ap)
    args = ap.parse_args(["--fp8", "kv,weights"])
    args.cp, args.cp_strategy = 1, None
    assert "valid: linear, kv, attention" in layout_error(args)
    assert fp8_config(ap.parse_args(["--fp8", "kv"])).kv
    # 8-bit scores live on the dense path, in Star's context blocks and in Ulysses: another strategy or --sparse with
    # them is refused before any model loads, by the CLI and by LLM alike
    for argv in (["--fp8", "attention", "--cp", "2"], ["--fp8", "linear,attention", "--cp-strategy", "apb"]):
        ap2 = argparse.ArgumentParser()
        add_fp8_arguments(ap2)
        add_layout_arguments(ap2)
        add_sparse_arguments(ap2)
        assert "runs on the dense path, in Star's context blocks and in Ulysses" in layout_error(ap2.parse_args(argv)), argv
    with pytest.raises(LayoutError, match="--cp 2 --cp-strategy ring: drop `attention` from --fp8"):
        LLM(random_weights="tiny", fp8="attention", parallel=ParallelConfig(cp=2, cp_strategy="ring"))
    with pytest.raises(LayoutError, match="with --sparse"):
        LLM(random_weights="tiny", fp8="attention", sparse=SparseConfig(method="minference"))


def test_gpu_without_fp8_is_refused(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100-SXM4-80GB")
    msg = fp8_kernels.fp8_support_error("cuda:0")
    assert "compute capability >= 8.9" in msg and "A100" in msg and "8.0" in msg
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert fp8_kernels.fp8_support_error("cuda:0") is None
    assert fp8_kernels.fp8_support_error("cpu") is None  # the reference path runs there


def test_cpu_says_it_is_the_slow_reference(caplog):
    fp8_kernels.warn_cpu_reference.cache_clear()
    with caplog.at_level("WARNING", logger="starshard"):
        LLM(random_weights="tiny", fp8="kv")
        LLM(random_weights="tiny", fp8="linear")
    said = [r for r in caplog.records if "slow reference" in r.getMessage()]
    assert len(said) == 1  # once per process


def test_planner_counts_fp8_bytes():
    cfg = ModelConfig.from_hf(PRESETS["llama-3.1-8b"])
    lay = Layout(1, 1, 1, "dense")
    bf16 = plan_memory(cfg, lay, Workload(131072)).worst
    kv = plan_memory(cfg, lay, Workload(131072, fp8_kv=True)).worst
    both = plan_memory(cfg, lay, Workload(131072, fp8_kv=True, fp8_linear=True)).worst
    # per token and layer: 2 x 8 heads x (128 + 4) bytes + 8 vs 2 x 8 x 256 + 8
    assert kv.kv_cache / bf16.kv_cache == pytest.approx((16 * 132 + 8) / (16 * 256 + 8))
    assert both.weights < 0.6 * bf16.weights  # projections in e4m3; embedding and head stay bf16
