"""Sliding-window Mistral, Qwen2 and Qwen3 (`use_sliding_window`, windowed from `max_window_layers` on)
against transformers: tiny random models saved by transformers, prompts of 80 tokens past a window of 16.
Before issue 38 these loaded and ran full attention, silently wrong; here every local layer attends the
keys at positions (p - 16, p] (transformers' convention: 16 keys, itself included), checked against the
neighbouring windows too. What cannot run a window yet is refused, naming the field."""
import json
from types import SimpleNamespace

import pytest
import torch
import transformers
from tests.helpers.hf_models import make_hf_model

from starshard.checkpoints.load import load_model
from starshard.config import ModelConfig, UnsupportedArchitectureError
from starshard.llm import LLM
from starshard.runtime.local import LocalRunner

transformers.logging.set_verbosity_error()

W = 16  # the sliding window
L = 80  # prompt tokens, 5 windows
STEPS = 8
FAMILIES = {
    "mistral": ("mistral", dict(sliding_window=W)),
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=W, max_window_layers=1)),
    "qwen3": ("qwen3", dict(use_sliding_window=True, sliding_window=W, max_window_layers=1)),
}
LOCAL = {"mistral": [0, 1, 2], "qwen2": [1, 2], "qwen3": [1, 2]}


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def ids_of(n, seed=1, batch=None):
    shape = (n,) if batch is None else (batch, n)
    return torch.randint(0, 211, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    base = tmp_path_factory.mktemp("swa")
    # Weights 5x transformers' default init: attention sharp enough that the window moves the logits.
    return {name: make_hf_model(arch, base / name, eos_token_id=None, initializer_range=0.1, **kw)
            for name, (arch, kw) in FAMILIES.items()}


def greedy(model, ids, steps, chunk=None):
    """Greedy decode through the KV cache (the prompt in chunks of `chunk`): (logits per step, tokens)."""
    cache = LocalRunner(model).new_cache(len(ids) + steps)
    rows, toks = [], []
    with torch.no_grad():
        if chunk:
            for s in range(0, len(ids) - chunk, chunk):
                model(ids[None, s : s + chunk], cache=cache)
            x = ids[None, (len(ids) - 1) // chunk * chunk :]
        else:
            x = ids[None]
        for _ in range(steps):
            rows.append(model(x, cache=cache, last_only=True)[0, -1])
            toks.append(int(rows[-1].argmax()))
            x = torch.tensor([[toks[-1]]])
    return torch.stack(rows), toks


def with_window(model, window):
    """The model's local layers set to another window (None: global), for the guards."""
    for layer in model.layers:
        if "window" in layer.attention.extras:
            if window is None:
                layer.attention.extras.pop("window")
            else:
                layer.attention.extras["window"] = window
    return model


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_prefill_logits_match_transformers(families, name):
    hf, path = families[name]
    model = load_model(path)
    assert model.config.sliding_window == W
    assert [i for i in range(3) if model.config.layer_window(i) == W] == LOCAL[name]
    assert model.config.layer_types == list(getattr(hf.config, "layer_types", None) or ["sliding_attention"] * 3)
    ids = ids_of(L, batch=2)
    with torch.no_grad():
        ref = hf(ids).logits
        out = model(ids)
        assert rel(out, ref) <= 1e-4, rel(out, ref)
        # Guards: full attention (what ran before) and the windows either side of W are all visibly off.
        for other in (None, W - 1, W + 1):
            assert rel(with_window(load_model(path), other)(ids), ref) > 1e-3, other


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_greedy_decode_matches_transformers(families, name):
    """LLM.generate's 8 greedy tokens (no sliding-window refusal any more) are transformers' generate's;
    each step's logits through the KV cache, whole prompt or in chunks of 24, equal its logits."""
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


def _hf_dict(**kw):
    d = dict(architectures=["Qwen2ForCausalLM"], vocab_size=211, hidden_size=48, intermediate_size=72,
             num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256)
    d.update(kw)
    return d


def test_window_configs_as_transformers_and_refused():
    """Which layers are local, per family, from the fields transformers reads; bad ones refused by name."""
    assert ModelConfig.from_hf(_hf_dict(sliding_window=W)).sliding_window is None  # no use_sliding_window
    c = ModelConfig.from_hf(_hf_dict(use_sliding_window=True, sliding_window=W, max_window_layers=1))
    assert c.layer_types == ["full_attention", "sliding_attention"] and c.attention_extras == ["sliding_window"]
    c = ModelConfig.from_hf(_hf_dict(use_sliding_window=True, sliding_window=W, max_window_layers=2))
    assert c.sliding_window is None and c.attention_extras == []  # no local layer: every layer global
    c = ModelConfig.from_hf(_hf_dict(architectures=["LlamaForCausalLM"], sliding_window=W))
    assert c.sliding_window is None  # transformers' Llama has no window
    for arch in ("MistralForCausalLM", "Phi3ForCausalLM"):
        c = ModelConfig.from_hf(_hf_dict(architectures=[arch], sliding_window=W))
        assert c.layer_types == ["sliding_attention"] * 2, arch
    c = ModelConfig.from_hf(_hf_dict(architectures=["MistralForCausalLM"], sliding_window=None))
    assert c.sliding_window is None and c.attention_extras == []
    # A window as long as the model's longest sequence hides nothing: plain attention (Phi-3-128K's 262144).
    c = ModelConfig.from_hf(_hf_dict(architectures=["Phi3ForCausalLM"], sliding_window=256))
    assert c.sliding_window is None and c.attention_extras == []
    assert ModelConfig.from_hf(_hf_dict(architectures=["Phi3ForCausalLM"], sliding_window=255)).sliding_window == 255
    moe = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)
    c = ModelConfig.from_hf(_hf_dict(architectures=["MixtralForCausalLM"], sliding_window=W, **moe))
    assert c.layer_types == ["sliding_attention"] * 2
    c = ModelConfig.from_hf(_hf_dict(architectures=["Qwen3MoeForCausalLM"], sliding_window=W, **moe))
    assert c.sliding_window is None  # no use_sliding_window
    c = ModelConfig.from_hf(_hf_dict(architectures=["Qwen3MoeForCausalLM"], sliding_window=W, use_sliding_window=True,
                                     max_window_layers=1, **moe))
    assert c.layer_types == ["sliding_attention"] * 2  # transformers' Qwen3-MoE: every layer
    with pytest.raises(UnsupportedArchitectureError, match=r"unsupported layer_types \['chunked_attention'\]"):
        ModelConfig.from_hf(_hf_dict(use_sliding_window=True, sliding_window=W,
                                     layer_types=["chunked_attention", "full_attention"]))
    with pytest.raises(UnsupportedArchitectureError, match=r"layer_types must list one type per layer \(2\)"):
        ModelConfig.from_hf(_hf_dict(use_sliding_window=True, sliding_window=W, layer_types=["full_attention"]))
    with pytest.raises(UnsupportedArchitectureError, match=r"sliding_window must be a positive integer"):
        ModelConfig.from_hf(_hf_dict(architectures=["MistralForCausalLM"], sliding_window=0))
    c = ModelConfig.from_hf(_hf_dict(use_sliding_window=True, sliding_window=W, max_window_layers=1))
    assert ModelConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    # Manifests written before per-layer windows (no layer_types): every layer where the family does that,
    # refused where the windowed layers are not recorded.
    old = {k: v for k, v in c.to_dict().items() if k not in ("layer_types", "local_rope_theta")}
    with pytest.raises(UnsupportedArchitectureError, match=r"converted before .*\(sliding_window=16, .*convert it again"):
        ModelConfig.from_dict(old)
    assert ModelConfig.from_dict(dict(old, arch="mistral")).layer_types == ["sliding_attention"] * 2
    assert ModelConfig.from_dict(dict(old, arch="phi3", sliding_window=256)).sliding_window is None


def test_paths_without_windows_hold_only_sequences_within_the_window(families):
    """--fp8 attention does not run a sliding window yet. It still runs a model whose only extra is its
    window on sequences within it, where the window hides nothing (as before issue 38), and refuses longer
    ones naming sliding_window and the fix; the service on such an LLM alike. The service itself runs the
    windows (tests/serving/test_windowed_service.py): it keeps them and takes the long prompt."""
    from starshard.serving.scheduler import Scheduler

    hf, path = families["qwen2"]
    ids = ids_of(W - 4, seed=3)
    with torch.no_grad():
        want = hf.generate(ids[None], attention_mask=torch.ones(1, W - 4, dtype=torch.long), max_new_tokens=4,
                           do_sample=False)[0, W - 4 :].tolist()
    long = ids_of(L).tolist()
    runs = [(dict(fp8="attention"), r"--fp8 attention \(8-bit prefill scores\)")]
    for kw, what in runs:
        llm = LLM(path, **kw)
        assert all("window" not in layer.attention.extras for layer in llm.model.layers)
        assert llm.generate(ids.tolist(), max_new_tokens=4).token_ids == want, what
        with pytest.raises(ValueError, match=r"prompt of 80 tokens \+ 4 new tokens exceeds the model's sliding window "
                                             rf"\(sliding_window=16\), and {what} does not run sliding windows yet"):
            llm.generate(long, max_new_tokens=4)
    svc = Scheduler(llm, cache_bytes=1 << 20)  # the last: --fp8 attention
    with pytest.raises(ValueError, match=r"exceeds the model's sliding window \(sliding_window=16\), and --fp8 att"):
        svc.submit(svc.text_prompt(long), max_tokens=4, sampling=None, on_event=None)
    llm = LLM(path)
    svc = Scheduler(llm, cache_bytes=1 << 20)
    assert llm.unwindowed is None and any("window" in layer.attention.extras for layer in llm.model.layers)
    svc.submit(svc.text_prompt(long), max_tokens=4, sampling=None, on_event=None)  # queued: no loop runs it
