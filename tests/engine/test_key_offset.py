"""--fp8 kv keys stored minus their constant part (engine/model.py key_offset): a k bias in the channels RoPE
barely turns (Qwen2 / 2.5) no longer ruins e4m3 keys, exactly (every score of a query moves alike), on one
process and through the context strategies."""
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from tests.helpers.hf_models import make_hf_model
from tests.helpers.mp_harness import run_ranks

from starshard import LLM
from starshard.config import ParallelConfig
from starshard.engine.model import rope_inv_freq

BIAS = 300.0  # Qwen2.5-Coder-1.5B: 354 in layer 0's keys, whose other values stay within 8


def _biased_qwen2(tmp_path, **overrides):
    """A small Qwen2 whose k bias is BIAS on the pair of channels RoPE turns least (head_dim 8: pair 3 turns
    0.51 rad over 512 positions) and whose queries read those channels, as a real one's do; prompt ids."""
    _, path = make_hf_model("qwen2", tmp_path, **overrides)
    f = next(path.glob("*.safetensors"))
    w = load_file(f)
    for name, b in w.items():
        if name.endswith("k_proj.bias"):
            b.view(-1, 8)[:, [3, 7]] += BIAS
        if name.endswith("q_proj.bias"):  # queries that read those channels, so their rounding shows in the scores
            b.view(-1, 8)[:, [3, 7]] += 1.5
    save_file(w, f, metadata={"format": "pt"})
    ids = torch.randint(0, 211, (97,), generator=torch.Generator().manual_seed(3)).tolist()
    return path, ids


def _last_logits(llm, ids):
    """Logits after `ids` from a decode step that reads the cache (prefill all but the last token)."""
    cache = llm.runner.new_cache(len(ids) + 2)
    with torch.inference_mode():
        llm.model(torch.tensor([ids[:-1]]), cache=cache)
        return llm.model(torch.tensor([ids[-1:]]), cache=cache, last_only=True)[0, -1].double()


def rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_the_offset_is_the_keys_constant_part(tmp_path):
    """The offset takes the bias (times YaRN's attention factor) off the channels that barely turn, only
    there, and only with --fp8 kv: the keys stored at every position of the window keep < 0.2 x BIAS there."""
    rs = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    path, _ = _biased_qwen2(tmp_path, rope_scaling=rs)
    assert all(layer.attention.k_offset is None for layer in LLM(path).model.layers)
    on = LLM(path, fp8="kv").model.layers[0].attention.k_offset
    fp8_weights = LLM(path, fp8="linear,kv").model.layers[0].attention  # the bias read from an Fp8Linear
    assert type(fp8_weights.wqkv).__name__ == "Fp8Linear" and torch.equal(fp8_weights.k_offset, on)
    llm = LLM(path, dtype=torch.float64)
    model, cfg = llm.model, llm.model.config
    model.smooth_keys(True)
    off = model.layers[0].attention.k_offset[:, 0]  # [Hkv, D]
    still = (rope_inv_freq(cfg) * cfg.max_position_embeddings < math.pi / 3).repeat(2)
    assert still.tolist() == [False, False, False, True] * 2
    assert (off[:, ~still] == 0).all() and (off[:, still] > 0.9 * BIAS * model.rope_scale).all()
    pos = torch.arange(0, cfg.max_position_embeddings, 5)
    cache = llm.runner.new_cache(len(pos) + 1)
    ids = torch.randint(0, 211, (1, len(pos)), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        model(ids, positions=pos, cache=cache)
    k = cache.layer(0).view()[0]  # [1, Hkv, n, D] as stored
    assert k.shape[2] == len(pos) and k[..., [3, 7]].abs().max() < 0.2 * BIAS


def test_the_offset_leaves_the_model_exact(tmp_path):
    """float64, no e4m3: the same logits with the offset as without it, at a step that reads the cache."""
    path, ids = _biased_qwen2(tmp_path)
    llm = LLM(path, dtype=torch.float64)
    ref = _last_logits(llm, ids)
    llm.model.smooth_keys(True)
    assert llm.model.layers[0].attention.k_offset is not None
    assert rel(_last_logits(llm, ids), ref) < 1e-12


def test_fp8_kv_with_a_large_k_bias_one_process(tmp_path):
    """e4m3 keys of a model with a large k bias: logits within 2 % of float32 keys' (max |delta| / max |logit|),
    and more than 5x further with the keys stored whole (with which Qwen2.5 lost half its right answers)."""
    path, ids = _biased_qwen2(tmp_path)
    ref = _last_logits(LLM(path), ids)
    llm = LLM(path, fp8="kv")
    smoothed = rel(_last_logits(llm, ids), ref)
    llm.model.smooth_keys(False)  # the keys stored whole, as before the offset
    whole = rel(_last_logits(llm, ids), ref)
    assert 0 < smoothed < 0.02 and whole > 5 * smoothed, (smoothed, whole)


LAYOUTS = [{"cp": 2, "cp_strategy": s} for s in ("ring", "ulysses", "star", "apb")]


def _strategies_rank(rank, world, path, ids):
    out = []
    for lay in LAYOUTS:
        row = {}
        for fp8 in (None, "kv"):
            llm = LLM(path, parallel=ParallelConfig(**lay), fp8=fp8)
            row[fp8] = llm.generate(ids, max_new_tokens=8).token_ids
        out.append(row)
    return out


def test_fp8_kv_with_a_large_k_bias_every_strategy(tmp_path):
    """cp=2 ring, Ulysses, Star and APB with e4m3 keys of a large-k-bias model: the tokens of a float32 cache."""
    path, ids = _biased_qwen2(tmp_path)
    results = run_ranks(_strategies_rank, 2, path, ids)
    for i, lay in enumerate(LAYOUTS):
        for r in results:
            assert r[i]["kv"] == r[i][None], lay


def test_a_compressor_trained_on_keys_is_refused_with_shifted_keys(tmp_path):
    """APB's retaining heads score the keys themselves, which the offset shifts: refused, naming the fix."""
    from starshard.parallel.topology import LayoutError
    path, _ = _biased_qwen2(tmp_path)
    g = torch.Generator().manual_seed(0)  # heads for the model's 6 q / 2 kv heads of 8, 3 layers (tests/parallel/test_apb.py)
    heads = {f"layers.{i}.{k}": t for i in range(3) for k, t in (("fc1.weight", torch.randn(16, 80, generator=g)),
                                                                  ("fc2.weight", torch.randn(2, 16, generator=g)))}
    save_file(heads, tmp_path / "heads.safetensors", metadata={"rope": "post", "pool": "1"})
    p = ParallelConfig(cp_strategy="apb", apb_hosts=2, compressor="retaining-heads",
                       compressor_path=str(tmp_path / "heads.safetensors"))
    assert LLM(path, parallel=p).generate([5, 7, 11, 13], max_new_tokens=2).token_ids  # runs without --fp8 kv
    with pytest.raises(LayoutError, match="compressor 'query', or drop kv from --fp8"):
        LLM(path, parallel=p, fp8="kv")
