"""Mixture-of-experts families against transformers: Qwen3-MoE (q/k norm, a dense layer among the
sparse ones via mlp_only_layers, top-k weights not renormalized) and Mixtral (every layer sparse,
renormalized), both with YaRN and prompts of 200 tokens past a 64-token original window. Tiny
random models built and saved by transformers in the test (per-expert tensors, as transformers 5
saves them); the router's weights drawn wide so tokens pick experts unevenly. Also: the router and
the grouped expert GEMM against a float64 per-token reference, shards, the planner's expert counts,
and tp=2 / pp=2 / cp=2 (ring, Star) on gloo equal to one process."""
import dataclasses
import json
import math

import pytest
import torch
import transformers
from tests.helpers.mp_harness import run_ranks
from tests.parallel.test_model_families_parallel import _cp_rank, _dense, _run
from tests.parallel.test_parallel_runtime import run_layouts

from starshard.checkpoints.convert import convert
from starshard.checkpoints.hf import StateDictSource, plan_shard
from starshard.checkpoints.load import load_model
from starshard.checkpoints.sources import (
    RandomSource,
    WeightSource,
    random_model,
    rank_state,
)
from starshard.config import ModelConfig, UnsupportedArchitectureError
from starshard.engine.moe import MoEFeedForward, grouped_experts, route
from starshard.partition import TPShard, check_tp
from starshard.llm import LLM
from starshard.planner import active_experts, decode_read_elements, weight_elements
from starshard.presets import preset_config

transformers.logging.set_verbosity_error()

ORIG = 64
L = 200
STEPS = 32
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIG, rope_theta=10000.0)
BASE = dict(vocab_size=211, hidden_size=48, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
            head_dim=8, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.1, eos_token_id=None,
            rope_parameters=YARN)
FAMILIES = {
    "qwen3-moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(intermediate_size=72, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
                       mlp_only_layers=[1], norm_topk_prob=False)),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(intermediate_size=24, num_local_experts=6, num_experts_per_tok=2)),
}


def make_moe_model(name, path, **overrides):
    config_cls, model_cls, kw = FAMILIES[name]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**BASE, **kw, **overrides})).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
            if n.endswith("gate.weight"):  # the router: sharp, uneven choices
                p.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    base = tmp_path_factory.mktemp("moe")
    return {name: (make_moe_model(name, base / name), base / name) for name in FAMILIES}


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def ids_of(n, seed=1, batch=None):
    shape = (n,) if batch is None else (batch, n)
    return torch.randint(0, 211, shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------- router and expert GEMM
def _reference(x, logits, top_k, renormalize, w13, w2):
    """float64, token by token: softmax, top k, (renormalize), sum of weighted SwiGLU experts."""
    x, logits, w13, w2 = x.double(), logits.double(), w13.double(), w2.double()
    F = w2.shape[-1]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        p = logits[t].softmax(-1)
        w, e = p.topk(top_k)
        if renormalize:
            w = w / w.sum()
        for wj, ej in zip(w, e):
            h = w13[ej] @ x[t]
            out[t] += wj * (w2[ej] @ (torch.nn.functional.silu(h[:F]) * h[F:]))
    return out


@pytest.mark.parametrize("impl,F", [("grouped", 16), ("gather", 10), ("padded", 10), ("gemv", 10), (None, 16),
                                    (None, 10)])
def test_router_and_grouped_experts_match_float64(impl, F):
    """Uneven loads: 8 experts, most tokens biased to experts 0-2, experts 6 and 7 never chosen; an odd
    token count; top-3, with and without renormalization. impl None: grouped_mm where the widths are
    16-byte aligned (F = 16), else the padded fallback (F = 10). gemv: the Triton decode kernels
    (interpreted on CPU), here over every pair of the batch."""
    g = torch.Generator().manual_seed(0)
    T, H, E, k = 37, 24, 8, 3
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * F, H, generator=g) * 0.2
    w2 = torch.randn(E, H, F, generator=g) * 0.2
    logits = torch.randn(T, E, generator=g)
    logits[:, :3] += 2.0 * torch.rand(T, 1, generator=g)
    logits[:, 6:] = -30.0
    for renormalize in (True, False):
        weights, experts = route(logits, k, renormalize)
        counts = torch.bincount(experts.flatten(), minlength=E)
        assert counts[6:].sum() == 0 and counts.max() > 2 * counts[3:6].min()
        got = grouped_experts(x, weights, experts, w13, w2, impl=impl)
        want = _reference(x, logits, k, renormalize, w13, w2)
        assert got.dtype == x.dtype
        assert rel(got, want) <= 1e-6, (impl, renormalize, rel(got, want))
    if impl == "gemv":  # one token (decode) in fp16 (the interpreter's bf16 is not trustworthy)
        got = grouped_experts(x[:1].half(), *route(logits[:1], k, True), w13.half(), w2.half(), impl=impl)
        assert got.dtype == torch.float16
        assert rel(got, _reference(x[:1], logits[:1], k, True, w13, w2)) <= 2e-3
    if impl in ("grouped", "gather") and F == 16:  # one token (decode), bf16: the same within bf16's precision
        got = grouped_experts(x[:1].bfloat16(), *route(logits[:1], k, True), w13.bfloat16(), w2.bfloat16(), impl=impl)
        assert rel(got, _reference(x[:1], logits[:1], k, True, w13, w2)) <= 2e-2


# ---------------------------------------------------------------------------- config
def test_config_reads_experts(families):
    q = load_model(families["qwen3-moe"][1]).config
    assert (q.arch, q.num_experts, q.num_experts_per_tok, q.moe_intermediate_size, q.norm_topk_prob) == (
        "qwen3_moe", 8, 2, 24, False)
    assert q.qk_norm and q.moe_layers == [0, 2] and q.intermediate_size == 72
    m = load_model(families["mixtral"][1]).config
    assert (m.arch, m.num_experts, m.moe_intermediate_size, m.norm_topk_prob, m.moe_layers) == (
        "mixtral", 6, 24, True, [0, 1, 2])
    for c in (q, m):
        assert ModelConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    step = ModelConfig.from_hf(dict(json.loads((families["qwen3-moe"][1] / "config.json").read_text()),
                                    decoder_sparse_step=2, mlp_only_layers=[], num_hidden_layers=4))
    assert step.moe_layers == [1, 3]
    model = load_model(families["qwen3-moe"][1])
    kinds = [isinstance(b.feed_forward, MoEFeedForward) for b in model.layers]
    assert kinds == [True, False, True]
    check_tp(q, 6)
    with pytest.raises(ValueError, match=r"expert intermediate 20\); valid tp sizes: \[1, 2\]"):
        check_tp(dataclasses.replace(q, moe_intermediate_size=20), 6)  # the experts' width alone refuses 6


def test_bad_moe_configs_are_refused(families):
    hf = json.loads((families["qwen3-moe"][1] / "config.json").read_text())
    with pytest.raises(UnsupportedArchitectureError, match=r"architectures=\['Qwen2MoeForCausalLM'\].*starshard "
                       r"supports \[.*'MixtralForCausalLM'.*'Qwen3MoeForCausalLM'\]"):
        ModelConfig.from_hf(dict(hf, architectures=["Qwen2MoeForCausalLM"]))
    with pytest.raises(UnsupportedArchitectureError, match=r"shared experts \(shared_expert_intermediate_size=64\)"):
        ModelConfig.from_hf(dict(hf, shared_expert_intermediate_size=64))
    with pytest.raises(UnsupportedArchitectureError, match=r"num_experts_per_tok=9, experts=8"):
        ModelConfig.from_hf(dict(hf, num_experts_per_tok=9))
    with pytest.raises(UnsupportedArchitectureError, match="decoder_sparse_step must be an integer >= 1"):
        ModelConfig.from_hf(dict(hf, decoder_sparse_step=0))


def test_moe_gguf_is_refused(families, tmp_path):
    """A Mixtral GGUF (as llama.cpp writes it: the `llama` architecture with expert tensors, which
    transformers' GGUF reader loads as a dense Llama without its experts) is refused from its metadata,
    before any tensor is read. Qwen3-MoE GGUFs convert: tests/checkpoints/test_moe_gguf.py."""
    from tests.checkpoints.test_moe_gguf import write_gguf

    gguf = write_gguf(families["mixtral"][0], tmp_path / "m.gguf", arch="llama", name="Mixtral-tiny")
    with pytest.raises(UnsupportedArchitectureError, match=r"m.gguf: a Mixtral GGUF \(general.architecture 'llama' "
                       r"with 6 experts\) is not supported: transformers' GGUF reader does not support Mixtral .*"
                       r"--hf DIR --out OUT"):
        convert(out=tmp_path / "out", gguf=gguf, progress=False)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------- single device vs transformers
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_prefill_logits_match_transformers(families, name):
    hf, path = families[name]
    model = load_model(path)
    ids = ids_of(L, batch=2)
    with torch.no_grad():
        ref = hf(ids).logits
        out = model(ids)
    assert rel(out, ref) <= 1e-4, rel(out, ref)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_greedy_decode_matches_transformers(families, name):
    """32 greedy tokens through starshard.LLM equal transformers' generate; each step's logits too."""
    hf, path = families[name]
    ids = ids_of(L, seed=2)
    llm = LLM(path)
    llm.eos_ids = set()  # the dir has no tokenizer; the fallback's end-of-text id must not stop the 32 steps
    ours = llm.generate(ids.tolist(), max_new_tokens=STEPS).token_ids
    assert len(ours) == STEPS
    with torch.no_grad():
        g = hf.generate(ids[None], attention_mask=torch.ones(1, L, dtype=torch.long), max_new_tokens=STEPS,
                        do_sample=False, output_logits=True, return_dict_in_generate=True)
        assert g.sequences[0, L:].tolist() == ours
        ref = torch.cat(g.logits)
        full = llm.model(torch.tensor([ids.tolist() + ours[:-1]]))[0, L - 1:]
    assert rel(full, ref) <= 1e-4, rel(full, ref)


# ---------------------------------------------------------------------------- checkpoints
def test_converted_shards_and_stacked_experts(families, tmp_path):
    """tp=2 x pp=2 shards of Qwen3-MoE from a sharded-index HF dir (per-expert tensors) merge back to
    the one-process model; each TP rank's tensors read from transformers' in-memory state dict
    (stacked [E, 2F, H] experts, Mixtral's `mlp.` names) equal those read from the saved files."""
    hf, _ = families["qwen3-moe"]
    src = tmp_path / "hf"
    hf.save_pretrained(src, max_shard_size="30KB")
    assert (src / "model.safetensors.index.json").is_file() and len(list(src.glob("*.safetensors"))) > 1
    ckpt = convert(out=tmp_path / "ckpt", hf_dir=src, tp=2, pp=2, dtype="float32", progress=False)
    a, b = load_model(src), load_model(ckpt)
    assert b.config == a.config
    sd_a, sd_b = a.state_dict(), b.state_dict()
    assert sd_a.keys() == sd_b.keys() and all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)
    with torch.no_grad():
        assert rel(b(ids_of(L, seed=4)[None]), hf(ids_of(L, seed=4)[None]).logits) <= 1e-4
    for name, (model, path) in families.items():
        cfg = load_model(path).config
        state = model.state_dict()
        assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
        for r in range(2):
            lay = TPShard(cfg, 2, r)
            x = rank_state(WeightSource("hf", path), cfg, lay, [0, 1, 2], True, True, 0, torch.float32, "cpu")
            y = {s.name: s.build() for s in plan_shard(cfg, StateDictSource(state), lay, [0, 1, 2], True, True)}
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), (name, r)
            assert x["layers.0.feed_forward.experts.w13"].shape == (cfg.num_experts, 24, 48)


# ---------------------------------------------------------------------------- planner
def test_planner_counts_every_expert_and_reads_active_ones():
    """qwen3-30b-a3b: 30.5B parameters, 3.3B active per token (Qwen's published sizes); per rank the
    planner's weights equal the shards the runtime builds, experts and routers included."""
    cfg = preset_config("qwen3-30b-a3b")
    total = weight_elements(cfg, 1, cfg.num_layers, True, True)
    assert 30.4e9 < total < 30.6e9
    # a decode step reads one embedding row, every router, the top-8 experts, attention and the head
    active = decode_read_elements(cfg, 1, cfg.num_layers, True, True)
    assert 3.2e9 < active + cfg.vocab_size * cfg.hidden_size < 3.4e9
    assert active_experts(cfg, 1) == 8 and 8 < active_experts(cfg, 4) < 32 and active_experts(cfg, 10_000) == 128
    mix = preset_config("mixtral-8x7b")
    assert 46.6e9 < weight_elements(mix, 1, mix.num_layers, True, True) < 46.8e9  # Mixtral 8x7B: 46.7B
    small = load_model_config_tiny()  # a dense layer among the sparse ones
    for c in (cfg, small):
        src = RandomSource(c, 0, None, "cpu")
        for tp in (1, 2):
            specs = plan_shard(c, src, TPShard(c, tp, tp - 1), [0, 1], True, False)
            assert weight_elements(c, tp, 2, True, False, layer_ids=[0, 1]) == sum(math.prod(s.shape) for s in specs)


def load_model_config_tiny():
    _, _, kw = FAMILIES["qwen3-moe"]
    hf = transformers.Qwen3MoeConfig(**{**BASE, **kw}).to_dict()
    hf["architectures"] = ["Qwen3MoeForCausalLM"]
    return ModelConfig.from_hf(hf)


# ---------------------------------------------------------------------------- parallel
@pytest.mark.slow
def test_tp2_and_pp2(families, tmp_path):
    """tp=2 from converted shards (Qwen3-MoE) and from the HF dir (Mixtral), tp=2 on random weights
    (every expert sliced per rank, equal to the one-process random model), pp=2 with a chunked
    prefill: the same greedy and sampled tokens and teacher-forced logits as one process."""
    ids = ids_of(L, seed=5)
    qwen, mixtral = families["qwen3-moe"][1], families["mixtral"][1]
    ckpt = convert(out=tmp_path / "q", hf_dir=qwen, tp=2, dtype="float32", progress=False)
    layouts = [
        {"name": "qwen3-moe-tp2-shards", "path": ckpt, "parallel": {"tp": 2}},
        {"name": "mixtral-tp2-hf", "path": mixtral, "parallel": {"tp": 2}},
        {"name": "qwen3-moe-tp2-random", "path": None, "random": str(qwen / "config.json"), "parallel": {"tp": 2}},
        {"name": "qwen3-moe-pp2", "path": qwen, "parallel": {"pp": 2}, "chunk": 64},
        {"name": "mixtral-pp2", "path": mixtral, "parallel": {"pp": 2}, "chunk": 64},
    ]
    results = run_layouts(layouts, 2, ids)
    assert [r[3]["layers"] for r in results] == [[0, 1], [2]]


@pytest.mark.slow
def test_cp2_ring_and_star(families):
    """cp=2 on gloo: ring equals the dense one-process run (last prompt token's logits, 8 greedy
    tokens); Star equals Star's two blocks run on one process."""
    cases = []
    for i, (name, (_, path)) in enumerate(families.items()):
        cases.append((name, path, ids_of(L, seed=10 + i), L - 8, L + 8))
    results = run_ranks(_cp_rank, 2, cases)
    for name, path, ids, C, R in cases:
        ref_logits, ref_tokens = _dense(path, ids, R)
        ring = [r[name, "ring"] for r in results]
        assert rel(ring[ring[0]["owner"]]["logits"], ref_logits) <= 1e-4, name
        assert all(r["tokens"] == ref_tokens for r in ring), name
        star_ref = _run(path, ids, C, R, "star", None)
        for r in results:
            s = r[name, "star"]
            assert rel(s["logits"], star_ref["logits"]) <= 1e-5, name
            assert s["tokens"] == star_ref["tokens"], name


def test_random_model_builds_experts():
    """Random weights (benchmarks): the MoE shapes, the same tensors as a tp=2 rank's slices."""
    cfg = load_model_config_tiny()
    model = random_model(cfg, dtype=torch.float32)
    ff = model.layers[0].feed_forward
    assert isinstance(ff, MoEFeedForward) and ff.experts.w13.shape == (8, 48, 48)
    part = rank_state(WeightSource("random", None, 0), cfg, TPShard(cfg, 2, 1), [0], True, False, 0,
                      torch.float32, "cpu")
    assert torch.equal(part["layers.0.feed_forward.experts.w2"], ff.experts.w2[:, :, 12:])
    assert torch.equal(part["layers.0.feed_forward.experts.w13"][:, 12:], ff.experts.w13[:, 36:])
    with torch.no_grad():
        assert torch.isfinite(model(ids_of(9)[None])).all()
