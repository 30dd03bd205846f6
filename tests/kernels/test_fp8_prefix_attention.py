"""A prefill block over an FP8 KV cache without a dequantized copy of the prefix (issue 19).

- attention_after_held (held prefix as stored + own keys as given, merged by lse) against one float64
  call over both;
- chunked prefill through the model on the CPU with an FP8 cache: the logits of the previous
  behaviour (dequantize the held prefix, then attend), and within FP8's error of the whole prompt
  run at once.
"""
import pytest
import torch

from starshard import LLM
from starshard.config import FP8_PREFILL_KEY_BLOCK
from starshard.engine import model as model_mod
from starshard.engine.kv_cache import LayerKV
from starshard.kernels.attention import attention, attention_after_held
from starshard.kernels.fp8 import FP8_DTYPE, dequantize, quantize_rows
from starshard.kernels.merge import merge_partials


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def reference(q, k, v, q_pos, k_pos, causal):
    """float64 masked softmax attention (explicit GQA repeat); empty rows: out 0, lse -inf."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = (q.double() @ kk.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.exp(s - lse[..., None]).nan_to_num(0.0) @ vv, lse


def fp8_keys(B, Hkv, Lk, D, g, v_mag=1.0):
    k = torch.randn(B, Hkv, Lk, D, generator=g) * torch.rand(B, Hkv, Lk, 1, generator=g).add(0.2) * 3
    v = torch.randn(B, Hkv, Lk, D, generator=g) * v_mag
    (k8, ks), (v8, vs) = quantize_rows(k), quantize_rows(v)
    return k8, ks, v8, vs


@pytest.mark.parametrize("Lq", [5, 29])  # decode-sized (math path) and prefill-sized (fused CPU path)
def test_attention_after_held_against_one_call(Lq):
    g = torch.Generator().manual_seed(Lq)
    B, Hq, Hkv, Lh, D = 1, 8, 2, 61, 16
    k8, ks, v8, vs = fp8_keys(B, Hkv, Lh, D, g)
    q = torch.randn(B, Hq, Lq, D, generator=g)
    k, v = torch.randn(B, Hkv, Lq, D, generator=g), torch.randn(B, Hkv, Lq, D, generator=g)
    held_pos, pos = torch.arange(Lh), torch.arange(Lh, Lh + Lq)
    out, lse = attention_after_held(q, k, v, pos, k8, v8, held_pos, k_scale=ks, v_scale=vs)
    kd, vd = dequantize(k8, ks, torch.float64), dequantize(v8, vs, torch.float64)
    want, want_lse = reference(q, torch.cat([kd, k.double()], 2), torch.cat([vd, v.double()], 2), pos,
                               torch.cat([held_pos, pos]), causal=True)
    assert rel(out, want) < 1e-5 and (lse.double() - want_lse).abs().max() < 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA dispatch of e4m3 prefixes")
# 100 rows: the split-KV kernel reads the e4m3 bytes (fp16 products, exact for e4m3): reference over the
# exact dequantized keys. 640 rows: the blocks are dequantized to the compute dtype (bf16) and run
# through cuDNN: reference over the keys as that kernel sees them, rounded to bf16 (the same rounding a
# bf16 cache stores).
@pytest.mark.parametrize("Lq, seen", [(100, torch.float64), (640, torch.bfloat16)])
def test_cuda_reads_the_prefix_in_place(Lq, seen):
    """On a GPU the held e4m3 prefix is never copied whole: a short block is read in e4m3 by the split-KV
    kernel, a longer one dequantizes FP8_PREFILL_KEY_BLOCK keys at a time (kernels/attention.py). The
    call allocates at most what the planner counts for one block (bf16 k and v and one float32
    temporary: half of a bf16 copy of this 4-block prefix) plus chunk-sized buffers, and matches float64
    attention over the dequantized keys."""
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(Lq)
    B, Hq, Hkv, Lh, D = 1, 32, 8, 4 * FP8_PREFILL_KEY_BLOCK, 128
    k8, ks, v8, vs = (t.to(dev) for t in fp8_keys(B, Hkv, Lh, D, g))
    q = torch.randn(B, Hq, Lq, D, generator=g).to(dev, torch.bfloat16)
    k, v = (torch.randn(B, Hkv, Lq, D, generator=g).to(dev, torch.bfloat16) for _ in range(2))
    held_pos, pos = torch.arange(Lh, device=dev), torch.arange(Lh, Lh + Lq, device=dev)
    attention_after_held(q, k, v, pos, k8, v8, held_pos, k_scale=ks, v_scale=vs)  # compile / plan first
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out, lse = attention_after_held(q, k, v, pos, k8, v8, held_pos, k_scale=ks, v_scale=vs)
    extra = torch.cuda.max_memory_allocated() - base
    block = FP8_PREFILL_KEY_BLOCK * Hkv * D * (2 * 2 + 4)  # as planner.stage_memory counts it
    assert block <= 2 * Lh * Hkv * D * 2 / 2  # half of a bf16 copy of the prefix's k and v
    assert extra < block + 64 * 2**20  # + the chunk's partial outputs and merge buffers
    heads = 4  # one KV head's query heads in float64
    kd = torch.cat([dequantize(k8[:, :1], ks[:, :1], seen).double(), k[:, :1].double()], 2)
    vd = torch.cat([dequantize(v8[:, :1], vs[:, :1], seen).double(), v[:, :1].double()], 2)
    want, want_lse = reference(q[:, :heads], kd, vd, pos, torch.cat([held_pos, pos]), causal=True)
    assert rel(out[:, :heads], want) < 1e-2 and (lse[:, :heads].double() - want_lse).abs().max() < 1e-2


def test_merge_keeps_empty_rows_and_inputs():
    g = torch.Generator().manual_seed(1)
    o1, o2 = torch.randn(1, 2, 3, 4, generator=g), torch.randn(1, 2, 3, 4, generator=g)
    l1, l2 = torch.randn(1, 2, 3, generator=g), torch.randn(1, 2, 3, generator=g)
    l1[0, 0, 0] = l2[0, 0, 0] = float("-inf")
    o1[0, 0, 0] = o2[0, 0, 0] = 0
    keep = o1.clone()
    out, lse = merge_partials(o1, l1, o2, l2)
    assert torch.equal(o1, keep)  # the inputs are not written (ring passes its running float32 buffer)
    w1 = torch.exp(l1 - lse)[..., None]
    want = w1 * o1 + torch.exp(l2 - lse)[..., None] * o2
    assert torch.isneginf(lse[0, 0, 0]) and (out[0, 0, 0] == 0).all()
    assert torch.allclose(out[0, 1:], want[0, 1:], atol=1e-6) and torch.allclose(out[0, 0, 1:], want[0, 0, 1:])


# ---------------------------------------------------------------------------- through the model
def _dequantize_then_attend(q, k, v, pos, held_k, held_v, held_pos, *, k_scale, v_scale, **extras):
    """The previous behaviour (LayerKV.append): the held prefix dequantized, then one call over all keys
    (extras: the layer's window / softcap / scale, as dense_attend passes them)."""
    kd, vd = dequantize(held_k, k_scale, q.dtype), dequantize(held_v, v_scale, q.dtype)
    return attention(q, torch.cat([kd, k], 2), torch.cat([vd, v], 2), q_pos=pos, k_pos=torch.cat([held_pos, pos]),
                     causal=True, **extras)


def _prefill_logits(llm, ids, chunk):
    """Logits of every chunk's last token, then of one decode step, with an FP8 cache."""
    cache = llm.runner.new_cache(len(ids) + 1)
    assert cache.layer(0).k.dtype == FP8_DTYPE
    out = []
    with torch.inference_mode():
        for s in range(0, len(ids) - 1, chunk):
            out.append(llm.model(torch.tensor([ids[s : min(s + chunk, len(ids) - 1)]]), cache=cache, last_only=True))
        out.append(llm.model(torch.tensor([ids[-1:]]), cache=cache, last_only=True))
    return out


def test_chunked_prefill_over_fp8_cache(monkeypatch):
    llm = LLM(random_weights="tiny", fp8="kv")
    ids = torch.randint(0, 512, (69,), generator=torch.Generator().manual_seed(4)).tolist()
    calls = []
    real = model_mod.attention_after_held
    monkeypatch.setattr(model_mod, "attention_after_held", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    # 68 prompt tokens in chunks of 17 (prefill-sized: more than DECODE_MAX_ROWS rows), then a decode step
    new = _prefill_logits(llm, ids, 17)
    assert len(calls) == 3 * len(llm.model.layers)  # every chunk after the first, every layer
    monkeypatch.setattr(model_mod, "attention_after_held", _dequantize_then_attend)
    old = _prefill_logits(llm, ids, 17)
    for a, b in zip(new, old):
        assert rel(a, b) < 1e-5
    # the whole prompt at once attends its own keys as computed; chunks read the held ones through e4m3
    whole = _prefill_logits(llm, ids, len(ids))
    assert 0 < rel(new[-2], whole[0]) < 0.02 and 0 < rel(new[-1], whole[-1]) < 0.02


def test_append_stored_hands_back_the_prefix_as_stored():
    g = torch.Generator().manual_seed(2)
    kv = LayerKV(1, 2, 16, 4, torch.float32, "cpu", fp8=True)
    k1, v1 = torch.randn(1, 2, 3, 16, generator=g), torch.randn(1, 2, 3, 16, generator=g)
    assert kv.append_stored(k1, v1, torch.arange(3)).k.shape[2] == 0
    held = kv.append_stored(torch.randn(1, 2, 5, 16, generator=g), torch.randn(1, 2, 5, 16, generator=g),
                            torch.arange(3, 8))  # grows past capacity 4: the views are of the new buffers
    assert kv.length == 8 and held.k.dtype == FP8_DTYPE and held.pos.tolist() == [0, 1, 2]
    assert held.k.data_ptr() == kv.k.data_ptr() and held.k_scale.shape == (1, 2, 3)
    k8, ks = quantize_rows(k1)
    assert torch.equal(held.k.view(torch.uint8), k8.view(torch.uint8)) and torch.equal(held.k_scale, ks)
