"""Gemma 2 and Gemma 3 (text) against transformers: tiny random models saved by transformers, prompts of
80 tokens past a sliding window of 16.

Gemma 2: every other layer local (the first one), attention and final logit soft-capping. Gemma 3: five
local layers per global one (here a pattern of 3 over 4 layers), q/k norms, the local layers' own RoPE
base, linear RoPE scaling on the global layers only. Both: RMSNorm by (1 + weight), norms after attention
and after the MLP, embeddings times sqrt(hidden), GeGLU, tied embeddings, query_pre_attn_scalar (here 10,
not head_dim, so the scale is tested). Each guard below turns one feature off and checks the logits move,
so no feature passes by being too small to see."""
import json

import pytest
import torch
import transformers
from tests.helpers.hf_models import make_hf_model

from starshard.checkpoints.convert import convert
from starshard.checkpoints.load import load_model
from starshard.config import ModelConfig, UnsupportedArchitectureError
from starshard.llm import LLM
from starshard.runtime.local import LocalRunner

transformers.logging.set_verbosity_error()

W = 16
L = 80
STEPS = 8
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 20000.0},
               "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}
FAMILIES = {
    "gemma2": ("gemma2", dict(sliding_window=W, query_pre_attn_scalar=10, attn_logit_softcapping=2.0,
                              final_logit_softcapping=3.0)),
    "gemma3": ("gemma3", dict(num_hidden_layers=4, sliding_window=W, sliding_window_pattern=3, query_pre_attn_scalar=10,
                              rope_parameters=GEMMA3_ROPE)),
}


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def ids_of(n, seed=1, batch=None):
    shape = (n,) if batch is None else (batch, n)
    return torch.randint(0, 211, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    base = tmp_path_factory.mktemp("gemma")
    return {name: make_hf_model(arch, base / name, eos_token_id=None, initializer_range=0.1, **kw)
            for name, (arch, kw) in FAMILIES.items()}


def greedy(model, ids, steps, chunk=None):
    """Greedy decode through the KV cache (the prompt in chunks of `chunk`): (logits per step, tokens)."""
    cache = LocalRunner(model).new_cache(len(ids) + steps)
    rows, toks = [], []
    with torch.no_grad():
        x = ids[None]
        if chunk:
            for s in range(0, len(ids) - chunk, chunk):
                model(ids[None, s : s + chunk], cache=cache)
            x = ids[None, (len(ids) - 1) // chunk * chunk :]
        for _ in range(steps):
            rows.append(model(x, cache=cache, last_only=True)[0, -1])
            toks.append(int(rows[-1].argmax()))
            x = torch.tensor([[toks[-1]]])
    return torch.stack(rows), toks


def _off(model, what):
    """The model with one feature turned off (for the guards)."""
    for layer in model.layers:
        ex = layer.attention.extras
        if what == "window":
            ex.pop("window", None)
        elif what in ex:
            ex.pop(what)
    if what == "final_softcap":
        model.config.final_logit_softcapping = None
    if what == "local_rope":
        model.local_inv_freq = model.inv_freq
    return model


def test_configs_resolve_as_transformers(families):
    g2 = load_model(families["gemma2"][1]).config
    assert g2.arch == "gemma2" and g2.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping, g2.query_pre_attn_scalar) == (2.0, 3.0, 10.0)
    assert g2.norm_unit_offset and g2.sandwich_norms and g2.tie_word_embeddings and not g2.qk_norm
    assert g2.hidden_act == "gelu_pytorch_tanh" and g2.embed_scale == pytest.approx(48 ** 0.5)
    assert g2.attention_extras == ["sliding_window", "attn_logit_softcapping", "query_pre_attn_scalar"]
    g3 = load_model(families["gemma3"][1]).config
    assert g3.arch == "gemma3" and g3.qk_norm and g3.local_rope_theta == 1000.0 and g3.rope_theta == 20000.0
    assert (g3.rope_scaling.type, g3.rope_scaling.factor) == ("linear", 2.0)
    assert g3.layer_types == ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    for c in (g2, g3):
        assert ModelConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    # The config.json of the Hub's Gemma 3 (before transformers 5): rope_theta / rope_scaling for the global
    # layers, rope_local_base_freq, sliding_window_pattern and no layer_types: the same model.
    hub = json.loads((families["gemma3"][1] / "config.json").read_text())
    for k in ("rope_parameters", "layer_types", "_sliding_window_pattern"):
        hub.pop(k)
    hub.update(rope_theta=20000.0, rope_local_base_freq=1000.0, rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert ModelConfig.from_hf(hub) == g3
    # Gemma 2 without layer_types: local, global, local, ... as Gemma2Config.
    g2_hub = json.loads((families["gemma2"][1] / "config.json").read_text())
    g2_hub.pop("layer_types")
    assert ModelConfig.from_hf(g2_hub) == g2


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_prefill_logits_match_transformers(families, name):
    hf, path = families[name]
    ids = ids_of(L, batch=2)
    guards = ["window", "scale"] + (["softcap", "final_softcap"] if name == "gemma2" else ["local_rope"])
    with torch.no_grad():
        ref = hf(ids).logits
        out = load_model(path)(ids)
        assert out.shape == ref.shape
        assert rel(out, ref) <= 1e-4, rel(out, ref)
        for what in guards:
            assert rel(_off(load_model(path), what)(ids), ref) > 1e-3, what


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_greedy_decode_matches_transformers(families, name):
    """LLM.generate's 8 greedy tokens are transformers' generate's, and every step's logits through the
    KV cache (prompt whole or in chunks of 24) equal its logits."""
    hf, path = families[name]
    ids = ids_of(L, seed=2)
    ours = LLM(path).generate(ids.tolist(), max_new_tokens=STEPS).token_ids
    with torch.no_grad():
        g = hf.generate(ids[None], attention_mask=torch.ones(1, L, dtype=torch.long), max_new_tokens=STEPS,
                        do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert g.sequences[0, L:].tolist() == ours and len(ours) == STEPS
    ref = torch.cat(g.logits)
    model = load_model(path)
    for chunk in (None, 24):
        logits, toks = greedy(model, ids, STEPS, chunk)
        assert toks == ours, chunk
        assert rel(logits, ref) <= 1e-4, (chunk, rel(logits, ref))


def test_converted_shards_round_trip(families, tmp_path):
    """tp=2 x pp=2 shards of Gemma 3 (four norms per layer, q/k norms whole on every rank) merge back to
    the HF dir's weights; a tp=1 checkpoint re-sliced in memory gives each rank what the HF dir does."""
    from starshard.checkpoints.sources import WeightSource, rank_state
    from starshard.partition import TPShard

    hf, path = families["gemma3"]
    ckpt = convert(out=tmp_path / "ckpt", hf_dir=path, tp=2, pp=2, dtype="float32", progress=False)
    a, b = load_model(path), load_model(ckpt)
    assert b.config == a.config
    sd_a, sd_b = a.state_dict(), b.state_dict()
    assert sd_a.keys() == sd_b.keys() and all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)
    cfg = a.config
    tp1 = convert(out=tmp_path / "tp1", hf_dir=path, dtype="float32", progress=False)
    for r in range(2):  # a tp=1 checkpoint re-sliced in memory = the HF dir sliced
        args = (cfg, TPShard(cfg, 2, r), [0, 1, 2, 3], True, True, 0, torch.float32, "cpu")
        x, y = rank_state(WeightSource("hf", path), *args), rank_state(WeightSource("default", tp1), *args)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), r


def test_planner_counts_gemma_norms(families):
    import math

    from starshard.checkpoints.hf import SafetensorsSource, plan_shard
    from starshard.partition import TPShard
    from starshard.planner import weight_elements

    _, path = families["gemma3"]
    cfg = load_model(path).config
    for tp in (1, 2):
        specs = plan_shard(cfg, SafetensorsSource(path), TPShard(cfg, tp, tp - 1), [0, 1], True, True)
        assert weight_elements(cfg, tp, 2, True, True) == sum(math.prod(s.shape) for s in specs), tp


def test_bad_gemma_configs_and_paths_are_refused(families):
    hub = json.loads((families["gemma3"][1] / "config.json").read_text())
    with pytest.raises(UnsupportedArchitectureError, match="use_bidirectional_attention=True"):
        ModelConfig.from_hf(dict(hub, use_bidirectional_attention=True))
    with pytest.raises(UnsupportedArchitectureError, match="gemma3 with attn_logit_softcapping=50.0"):
        ModelConfig.from_hf(dict(hub, attn_logit_softcapping=50.0))
    rope = {"full_attention": GEMMA3_ROPE["full_attention"],
            "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0}}
    with pytest.raises(UnsupportedArchitectureError, match=r"rope_parameters.sliding_attention"):
        ModelConfig.from_hf(dict(hub, rope_parameters=rope))
    with pytest.raises(UnsupportedArchitectureError, match=r"unsupported layer_types \['chunked_attention'\]"):
        ModelConfig.from_hf(dict(hub, layer_types=["chunked_attention"] * 4))
    # Soft-caps and scales have no plain-attention fallback: sparse prefill (its patterns) and --fp8
    # attention refuse the model, naming the fields and the fix. The service runs them (its cascade takes
    # them: tests/serving/test_windowed_service.py).
    from starshard.kernels.sparse import SparseConfig
    from starshard.serving.scheduler import Scheduler

    _, path = families["gemma2"]
    what = r"gemma2's sliding_window / attn_logit_softcapping / query_pre_attn_scalar \(sliding_window=16, "
    with pytest.raises(ValueError, match=r"sparse prefill \(anchor\) does not run " + what + r".*without --sparse"):
        LLM(path, sparse=SparseConfig("anchor"))
    with pytest.raises(ValueError, match=r"--fp8 attention .* does not run " + what + r".*drop `attention`"):
        LLM(path, fp8="attention")
    llm = LLM(path)
    assert Scheduler(llm, cache_bytes=1 << 20).config.attn_logit_softcapping == 2.0 and llm.unwindowed is None


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_graph_decode_step_matches_transformers(families, name):
    """The device-indexed decode step CUDA graphs replay (run eagerly here) gives each local layer its
    window, Gemma 2's soft-cap and the query_pre_attn_scalar scale: its logits are transformers'."""
    from starshard.runtime.cuda_graph import GraphDecoder

    hf, path = families[name]
    ids = ids_of(L, seed=2)
    with torch.no_grad():
        g = hf.generate(ids[None], attention_mask=torch.ones(1, L, dtype=torch.long), max_new_tokens=STEPS,
                        do_sample=False, output_logits=True, return_dict_in_generate=True)
        model = load_model(path)
        cache = LocalRunner(model).new_cache(L + STEPS)
        rows = [model(ids[None], cache=cache, last_only=True)[0, -1]]
        dec = GraphDecoder(model, cache, capture=False)
        for t in g.sequences[0, L : L + STEPS - 1].tolist():
            rows.append(dec.step(torch.tensor([[t]]))[0, -1].clone())
    ref = torch.cat(g.logits)
    assert rel(torch.stack(rows), ref) <= 1e-4, rel(torch.stack(rows), ref)
