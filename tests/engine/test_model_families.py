"""Long-context model families against transformers: Qwen3 (q/k norm), Phi-3 (fused qkv / gate_up,
LongRoPE, partial rotary), Qwen2 / Llama with YaRN, Llama with dynamic NTK. Tiny random models built
and saved by transformers in the test; prompts of 200 tokens past a 64-token original window.

RoPE length rule (engine/model.py, Transformer): dynamic and longrope frequencies depend on a length,
which a run fixes once (`set_rope_length(prompt + max_new_tokens)`); every token of the run, prefill
and decode, on every rank, is rotated with those frequencies. A run of length R therefore equals
transformers' single forward over R tokens, row for row.
"""
import json
import math

import pytest
import torch
import transformers
from tests.helpers.hf_models import make_hf_model

from starshard.checkpoints.convert import convert
from starshard.checkpoints.load import load_model
from starshard.config import ModelConfig, UnsupportedArchitectureError
from starshard.engine.model import rope_inv_freq
from starshard.llm import LLM
from starshard.runtime.local import LocalRunner

transformers.logging.set_verbosity_error()

ORIG = 64  # the original (pre-scaling) window
L = 200  # prompt tokens: past ORIG
STEPS = 32  # greedy decode steps against transformers' generate
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIG)
LONGROPE = dict(rope_type="longrope", short_factor=[1.0 + 0.1 * i for i in range(4)],
                long_factor=[1.5 + 0.7 * i for i in range(4)])
FAMILIES = {
    "qwen3": ("qwen3", dict(max_position_embeddings=256)),
    "qwen3-yarn": ("qwen3", dict(max_position_embeddings=256, rope_scaling=YARN)),
    "qwen2-yarn": ("qwen2", dict(max_position_embeddings=256, rope_scaling=YARN)),
    # DeepSeek-style: attention factor from mscale / mscale_all_dim, custom betas, no truncation
    "llama-yarn-mscale": ("llama", dict(max_position_embeddings=256, rope_scaling=dict(
        YARN, mscale=0.707, mscale_all_dim=1.0, beta_fast=16, beta_slow=2, truncate=False))),
    "qwen2-yarn-attention-factor": ("qwen2", dict(max_position_embeddings=512, rope_scaling=dict(
        YARN, factor=8.0, attention_factor=1.3))),
    "phi3-longrope": ("phi3", dict(max_position_embeddings=256, original_max_position_embeddings=ORIG,
                                   rope_scaling=LONGROPE)),
    "phi3-longrope-partial-rotary": ("phi3", dict(max_position_embeddings=256, original_max_position_embeddings=ORIG,
                                                  partial_rotary_factor=0.5,
                                                  rope_scaling=dict(LONGROPE, short_factor=[1.0, 1.2],
                                                                    long_factor=[2.0, 3.5]))),
    "llama-dynamic": ("llama", dict(max_position_embeddings=ORIG, rope_scaling=dict(rope_type="dynamic", factor=4.0))),
}


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def ids_of(n, seed=1, batch=None):
    shape = (n,) if batch is None else (batch, n)
    return torch.randint(0, 211, shape, generator=torch.Generator().manual_seed(seed))


def fresh_hf(path):
    """transformers' dynamic RoPE keeps state between forwards (the longest length seen): compare
    against a freshly loaded model."""
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    base = tmp_path_factory.mktemp("families")
    # Weights 5x transformers' default init: attention sharp enough that a wrong frequency or attention
    # factor moves the logits by 10-40 % (at std 0.02 some only by 0.1 %, too close to the tolerance).
    return {name: make_hf_model(arch, base / name, eos_token_id=None, initializer_range=0.1, **kw)
            for name, (arch, kw) in FAMILIES.items()}


def greedy(model, ids, steps):
    """Greedy decode through the KV cache: (logits of each step [steps, V], tokens)."""
    cache = LocalRunner(model).new_cache(len(ids) + steps)
    rows, toks = [], []
    with torch.no_grad():
        x = ids[None]
        for _ in range(steps):
            rows.append(model(x, cache=cache, last_only=True)[0, -1])
            toks.append(int(rows[-1].argmax()))
            x = torch.tensor([[toks[-1]]])
    return torch.stack(rows), toks


# ---------------------------------------------------------------------------- config
def test_configs_resolve_as_transformers(families):
    cfg = {n: load_model(p).config for n, (_, p) in families.items()}
    assert cfg["qwen3"].arch == "qwen3" and cfg["qwen3"].qk_norm and not cfg["qwen3"].qkv_bias
    y = cfg["qwen3-yarn"].rope_scaling
    assert (y.type, y.factor, y.original_max_position_embeddings) == ("yarn", 4.0, ORIG)
    assert y.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1)
    m = cfg["llama-yarn-mscale"].rope_scaling
    assert m.attention_factor == pytest.approx((0.1 * 0.707 * math.log(4) + 1) / (0.1 * math.log(4) + 1))
    assert (m.beta_fast, m.beta_slow, m.truncate) == (16, 2, False)
    assert cfg["qwen2-yarn-attention-factor"].rope_scaling.attention_factor == 1.3
    p = cfg["phi3-longrope"]
    assert p.arch == "phi3" and p.rope_scaling.type == "longrope" and p.rope_scaling.original_max_position_embeddings == ORIG
    assert p.rope_scaling.attention_factor == pytest.approx(math.sqrt(1 + math.log(256 / ORIG) / math.log(ORIG)))
    assert cfg["phi3-longrope-partial-rotary"].rope_dim == 4
    # The window every check reads: yarn factor x original, dynamic factor x HF's max_position_embeddings.
    assert cfg["qwen3-yarn"].max_position_embeddings == 256
    assert cfg["qwen2-yarn-attention-factor"].max_position_embeddings == 8 * ORIG
    d = cfg["llama-dynamic"]
    assert d.max_position_embeddings == 4 * ORIG and d.rope_scaling.original_max_position_embeddings == ORIG
    # Old manifests (no new fields) and new ones round-trip.
    for c in cfg.values():
        assert ModelConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_inv_freq_matches_transformers(families):
    """Our frequencies and attention factor = transformers' rope init functions (dynamic and longrope
    at lengths on both sides of the original window)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for name, (hf, path) in families.items():
        cfg = load_model(path).config
        rtype = cfg.rope_scaling.type
        lengths = [None] if rtype not in ("dynamic", "longrope") else [ORIG // 2, ORIG, ORIG + 1, L]
        for n in lengths:
            if rtype == "default":
                continue
            want, af = ROPE_INIT_FUNCTIONS[rtype](hf.config, "cpu", seq_len=n)
            assert torch.allclose(rope_inv_freq(cfg, n), want, rtol=1e-6, atol=0), (name, n)
            assert cfg.rope_scaling.attention_factor == pytest.approx(af), name


# ---------------------------------------------------------------------------- single device vs transformers
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_prefill_logits_match_transformers(families, name):
    """One forward over L = 200 tokens (past the 64-token original window), batch 2: a run of length
    L equals transformers' forward over L tokens."""
    _, path = families[name]
    model = load_model(path)
    model.set_rope_length(L)
    ids = ids_of(L, batch=2)
    with torch.no_grad():
        ref = fresh_hf(path)(ids).logits
        out = model(ids)
    assert out.shape == ref.shape
    assert rel(out, ref) <= 1e-4, rel(out, ref)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_greedy_decode_matches_transformers(families, name):
    """starshard.LLM on token ids with the runtime's rope length (prompt + new tokens), then the same
    decode through the KV cache with its logits kept. Every type but dynamic: the same 32 greedy
    tokens as transformers' generate, each step's logits equal to its generate's. dynamic:
    transformers' generate re-derives the NTK base at each decode step from the grown length while
    the cached keys keep the old rotation (here its tokens part from ours at step 28 of 32); our run
    fixes the base for its whole length, so every step equals transformers' single forward over the
    final L + 32 tokens, and the tokens are that forward's greedy ones."""
    _, path = families[name]
    ids = ids_of(L, seed=2)
    llm = LLM(path)
    llm.model.set_rope_length(L + STEPS)
    ours = llm.generate(ids.tolist(), max_new_tokens=STEPS).token_ids
    logits, toks = greedy(llm.model, ids, STEPS)
    assert toks == ours and len(ours) == STEPS
    if llm.config.rope_scaling.type == "dynamic":
        with torch.no_grad():
            ref = fresh_hf(path)(torch.tensor([ids.tolist() + toks])).logits[0, L - 1 : L + STEPS - 1]
        assert ref.argmax(-1).tolist() == ours
    else:
        with torch.no_grad():
            g = fresh_hf(path).generate(ids[None], attention_mask=torch.ones(1, L, dtype=torch.long),
                                        max_new_tokens=STEPS, do_sample=False, output_logits=True,
                                        return_dict_in_generate=True)
        assert g.sequences[0, L:].tolist() == ours
        ref = torch.cat(g.logits)
    assert rel(logits, ref) <= 1e-4, rel(logits, ref)


# ---------------------------------------------------------------------------- the RoPE length rule
def test_length_dependent_rope_is_fixed_per_run(families):
    """dynamic / longrope: a run of length R (prompt + max new tokens) gives each token transformers'
    frequencies for a forward over R tokens, also when the prompt alone fits the original window
    (transformers would switch mid-run); R within the window keeps the short factors / base; unset =
    the model's window. The buffer is updated in place (a bound APB strategy or a CUDA graph keeps
    reading it); other types ignore the length."""
    for name in ("phi3-longrope", "llama-dynamic"):
        _, path = families[name]
        model = load_model(path)
        ptr = model.inv_freq.data_ptr()
        n_prompt, n_new = 40, 32  # prompt inside the window, run past it
        ids = ids_of(n_prompt + n_new, seed=3)
        with torch.no_grad():
            full = fresh_hf(path)(ids[None]).logits[0]  # transformers, R = 72 tokens
            short = fresh_hf(path)(ids[None, :n_prompt]).logits[0]  # transformers, 40 tokens
            model.set_rope_length(n_prompt + n_new)
            assert rel(model(ids[None, :n_prompt])[0], full[:n_prompt]) <= 1e-4, name
            model.set_rope_length(n_prompt)
            assert rel(model(ids[None, :n_prompt])[0], short) <= 1e-4, name
            assert rel(short, full[:n_prompt]) > 1e-2  # guards the test: the two lengths differ
            model.set_rope_length(None)
            assert torch.equal(model.inv_freq, rope_inv_freq(model.config, model.config.max_position_embeddings))
        assert model.inv_freq.data_ptr() == ptr
    model = load_model(families["qwen3-yarn"][1])
    before = model.inv_freq.clone()
    model.set_rope_length(7)
    assert torch.equal(model.inv_freq, before)


# ---------------------------------------------------------------------------- converter, loader, planner
@pytest.mark.parametrize("name", ["phi3-longrope", "qwen3-yarn"])
def test_converted_shards_round_trip(families, name, tmp_path):
    """tp=2 x pp=2 shards (Phi-3's fused qkv / gate_up split per TP rank, Qwen3's q/k norms on every
    rank), merged back by load_model, from a HF dir saved in several safetensors files."""
    hf, _ = families[name]
    src = tmp_path / "hf"
    hf.save_pretrained(src, max_shard_size="30KB")
    assert len(list(src.glob("*.safetensors"))) > 1
    ckpt = convert(out=tmp_path / "ckpt", hf_dir=src, tp=2, pp=2, dtype="float32", progress=False)
    a, b = load_model(src), load_model(ckpt)
    assert b.config == a.config
    ids = ids_of(L, seed=4)[None]
    with torch.no_grad():
        ref = fresh_hf(src)(ids).logits
        assert rel(b(ids), ref) <= 1e-4
    sd_a, sd_b = a.state_dict(), b.state_dict()
    assert sd_a.keys() == sd_b.keys() and all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)


def test_tp_slices_of_fused_phi3_and_resliced_default(families, tmp_path):
    """Per-rank tensors of Phi-3 read from the HF dir (fused, split on the fly) equal those re-sliced
    from a tp=1 starshard checkpoint (the embedded default's path) and those of a Llama-layout copy."""
    from starshard.checkpoints.sources import WeightSource, rank_state
    from starshard.partition import TPShard

    _, path = families["phi3-longrope"]
    cfg = load_model(path).config
    ckpt = convert(out=tmp_path / "tp1", hf_dir=path, dtype="float32", progress=False)
    for tp in (2, 6):  # 6 replicates the 2 KV heads
        for r in range(tp):
            lay = TPShard(cfg, tp, r)
            args = (cfg, lay, [0, 1, 2], True, True, 0, torch.float32, "cpu")
            a = rank_state(WeightSource("hf", path), *args)
            b = rank_state(WeightSource("default", ckpt), *args)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (tp, r)


def test_planner_counts_qwen3_norms():
    """The planner counts Qwen3's q/k norms: the qwen3-8b preset has Qwen3-8B's published size
    (model.safetensors.index.json total_size 16381470720 bytes in bf16), and per rank it equals the
    shards the runtime builds."""
    from starshard.checkpoints.hf import plan_shard
    from starshard.checkpoints.sources import RandomSource
    from starshard.partition import TPShard
    from starshard.planner import weight_elements
    from starshard.presets import preset_config

    cfg = preset_config("qwen3-8b")
    assert weight_elements(cfg, 1, cfg.num_layers, True, True) * 2 == 16_381_470_720
    src = RandomSource(cfg, 0, None, "cpu")
    for tp in (1, 2, 8):
        specs = plan_shard(cfg, src, TPShard(cfg, tp, tp - 1), [0, 1], True, False)
        assert weight_elements(cfg, tp, 2, True, False) == sum(math.prod(s.shape) for s in specs)


# ---------------------------------------------------------------------------- bad input
def _hf_dict(**kw):
    d = dict(architectures=["Qwen3ForCausalLM"], vocab_size=211, hidden_size=48, intermediate_size=72,
             num_hidden_layers=1, num_attention_heads=6, num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    d.update(kw)
    return d


def test_bad_configs_are_refused_with_what_is_supported(families, tmp_path):
    supported = r"supported: default, linear, llama3, yarn, dynamic, longrope"
    with pytest.raises(UnsupportedArchitectureError, match=r"unsupported rope scaling type 'proportional'; " + supported):
        ModelConfig.from_hf(_hf_dict(rope_scaling=dict(rope_type="proportional", factor=2.0)))
    with pytest.raises(UnsupportedArchitectureError, match=r"architectures=\['Qwen2MoeForCausalLM'\].*"
                                                          r"'Phi3ForCausalLM', 'Qwen2ForCausalLM', 'Qwen3ForCausalLM'"):
        ModelConfig.from_hf(_hf_dict(architectures=["Qwen2MoeForCausalLM"]))
    with pytest.raises(UnsupportedArchitectureError, match=r"longrope needs `short_factor` with 4 numbers"):
        ModelConfig.from_hf(_hf_dict(architectures=["Phi3ForCausalLM"], original_max_position_embeddings=64,
                                     rope_scaling=dict(rope_type="longrope", short_factor=[1.0], long_factor=[1.0] * 4)))
    with pytest.raises(UnsupportedArchitectureError, match="'dynamic' needs a `factor`"):
        ModelConfig.from_hf(_hf_dict(rope_scaling=dict(rope_type="dynamic")))
    with pytest.raises(UnsupportedArchitectureError, match="attention_bias=True"):
        ModelConfig.from_hf(_hf_dict(attention_bias=True))
    with pytest.raises(UnsupportedArchitectureError, match="hidden_act='gelu'"):
        ModelConfig.from_hf(_hf_dict(hidden_act="gelu"))
    # Phi-3's old names for LongRoPE are read as longrope, as Phi3Config does.
    phi = _hf_dict(architectures=["Phi3ForCausalLM"], original_max_position_embeddings=64,
                   rope_scaling=dict(type="su", short_factor=[1.0] * 4, long_factor=[2.0] * 4))
    assert ModelConfig.from_hf(phi).rope_scaling.type == "longrope"
    # Through the loader and the converter: a model dir with an unknown rope type.
    _, path = families["qwen3-yarn"]
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in path.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_parameters"]["rope_type"] = "mrope"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="'mrope'; " + supported):
        load_model(bad)
    with pytest.raises(UnsupportedArchitectureError, match="'mrope'"):
        convert(out=tmp_path / "out", hf_dir=bad, progress=False)
    # A fused tensor that does not fit the config's heads names both sizes.
    phi_dir = tmp_path / "phi"
    phi_dir.mkdir()
    _, ppath = families["phi3-longrope"]
    for f in ppath.iterdir():
        (phi_dir / f.name).write_bytes(f.read_bytes())
    pcfg = json.loads((ppath / "config.json").read_text())
    pcfg["num_key_value_heads"] = 3
    (phi_dir / "config.json").write_text(json.dumps(pcfg))
    with pytest.raises(ValueError, match=r"qkv_proj.weight has 80 rows, but the config's heads and MLP width give 96"):
        load_model(phi_dir)
