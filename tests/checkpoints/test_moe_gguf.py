"""Mixture-of-experts GGUF files. A tiny random Qwen3-MoE built by transformers is written as a GGUF
with the `gguf` package (F32 tensors under llama.cpp's names and metadata keys, a byte-level BPE
tokenizer in the metadata), converted through transformers' GGUF reader and compared with the
transformers model: logits, greedy tokens, tokenizer, tp=2 shards, tp=2 / pp=2 runs from the file.
Its experts are 24 wide and its heads 16 wide (neither Qwen3MoeConfig's default nor hidden / heads),
so the metadata transformers does not map (`expert_feed_forward_length`) must reach the config.
Refused: a transformers too old for Qwen3-MoE GGUFs, other MoE architectures, YaRN metadata the reader
ignores, a file missing a tensor. Mixtral GGUFs (llama.cpp's `llama` with experts, which transformers
reads as a dense Llama without them): test_model_families_moe.py::test_moe_gguf_is_refused."""

import gguf
import numpy as np
import pytest
import torch
import transformers
from transformers.convert_slow_tokenizer import bytes_to_unicode

from starshard.checkpoints.convert import _transformers_gguf_config, convert, gguf_hf_config
from starshard.checkpoints.load import load_model, load_shard, read_manifest
from starshard.checkpoints.sources import rank_state, read_config, weight_source
from starshard.config import ModelConfig, UnsupportedArchitectureError
from starshard.partition import TPShard
from starshard.llm import LLM

transformers.logging.set_verbosity_error()

# A byte-level BPE vocabulary: the 256 byte symbols, a few merges, one control token (end of text).
BYTES = list(bytes_to_unicode().values())
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "e r", "a n", "Ġ a", "o n"]
TOKENS = BYTES + [m.replace(" ", "") for m in MERGES] + ["<|endoftext|>"]
EOS = len(TOKENS) - 1
QWEN3_MOE = dict(vocab_size=len(TOKENS), hidden_size=48, num_hidden_layers=3, num_attention_heads=6,
                 num_key_value_heads=2, head_dim=16, intermediate_size=72, moe_intermediate_size=24, num_experts=8,
                 num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256, rms_norm_eps=1e-5,
                 initializer_range=0.1, eos_token_id=EOS, bos_token_id=EOS, tie_word_embeddings=False,
                 rope_parameters=dict(rope_type="default", rope_theta=1e6))
L = 64
STEPS = 16


def perturbed(model):
    """Norm weights off 1 and a router drawn wide (uneven expert choices), as in test_model_families_moe."""
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
            if n.endswith("gate.weight"):
                p.normal_(0.0, 0.5)
    return model.eval()


def _experts(state, prefix, F):
    """(gate [E, F, H], up [E, F, H], down [E, H, F]) of one layer: transformers 5 holds them stacked
    in memory, transformers 4 one module per expert."""
    if prefix + "experts.gate_up_proj" in state:
        w13 = state[prefix + "experts.gate_up_proj"]
        return w13[:, :F], w13[:, F:], state[prefix + "experts.down_proj"]
    n = len({k.split(".")[-3] for k in state if k.startswith(prefix + "experts.")})
    get = lambda e, p: state[f"{prefix}experts.{e}.{p}.weight"]  # noqa: E731
    return tuple(torch.stack([get(e, p) for e in range(n)]) for p in ("gate_proj", "up_proj", "down_proj"))


def write_gguf(model, path, *, arch="qwen3moe", name="tiny-qwen3-moe", dtype=np.float32, skip=(),
               yarn=None):
    """The model as llama.cpp's converter lays it out: metadata under `{arch}.*` keys, tensors under
    GGUF names (experts stacked per layer as ffn_{gate,up,down}_exps), the tokenizer above. For the
    llama architecture (how llama.cpp writes Mixtral) q and k are not permuted: only the refusal reads it.
    skip: GGUF tensor names left out. yarn: (factor, original context) as llama.cpp writes YaRN."""
    c, state = model.config, model.state_dict()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if yarn:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(yarn[0])
        w.add_rope_scaling_orig_ctx_len(yarn[1])
    experts = getattr(c, "num_experts", None) or c.num_local_experts
    w.add_expert_count(experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    F = getattr(c, "moe_intermediate_size", c.intermediate_size)
    w.add_expert_feed_forward_length(F)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if dtype == np.float32 else gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(TOKENS)
    w.add_token_types([gguf.TokenType.NORMAL] * (len(TOKENS) - 1) + [gguf.TokenType.CONTROL])
    w.add_token_merges(MERGES)
    w.add_eos_token_id(EOS)
    w.add_bos_token_id(EOS)
    w.add_add_bos_token(False)

    def put(gguf_name, t):
        if gguf_name in skip:
            return
        a = t.detach().float().numpy()
        w.add_tensor(gguf_name, a if a.ndim == 1 else a.astype(dtype))  # llama.cpp keeps 1-D tensors in F32

    put("token_embd.weight", state["model.embed_tokens.weight"])
    put("output_norm.weight", state["model.norm.weight"])
    put("output.weight", state["lm_head.weight"])
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for ours, theirs in [("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
                             ("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"),
                             ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                             ("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm"),
                             ("ffn_gate_inp", "mlp.gate")]:
            if p + theirs + ".weight" in state:
                put(f"blk.{i}.{ours}.weight", state[p + theirs + ".weight"])
        gate, up, down = _experts(state, f"{p}mlp.", F)
        put(f"blk.{i}.ffn_gate_exps.weight", gate)
        put(f"blk.{i}.ffn_up_exps.weight", up)
        put(f"blk.{i}.ffn_down_exps.weight", down)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    """(transformers model, F32 GGUF of it)."""
    model = perturbed(transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**QWEN3_MOE)))
    return model, write_gguf(model, tmp_path_factory.mktemp("gguf") / "qwen3-moe.gguf")


@pytest.fixture(scope="module")
def converted(qwen3_moe, tmp_path_factory):
    return convert(out=tmp_path_factory.mktemp("ckpt"), gguf=qwen3_moe[1], dtype="float32", progress=False)


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def ids_of(n, seed, batch=None):
    shape = (n,) if batch is None else (batch, n)
    return torch.randint(0, len(TOKENS), shape, generator=torch.Generator().manual_seed(seed))


def test_config_has_the_fields_transformers_leaves_out(qwen3_moe, converted, monkeypatch, request):
    """Expert width from `expert_feed_forward_length`, head_dim from `attention.key_length`, top-k weights
    renormalized (llama.cpp's qwen3moe) also where transformers' reader does not default them so (before
    5.0: its GGUF defaults dropped here), every layer sparse; the manifest records the GGUF source."""
    from transformers.integrations import ggml

    monkeypatch.delitem(getattr(ggml, "GGUF_CONFIG_DEFAULTS_MAPPING", {"qwen3_moe": 0}), "qwen3_moe")
    _transformers_gguf_config.cache_clear()  # read again without the defaults (and again after the test)
    request.addfinalizer(_transformers_gguf_config.cache_clear)
    cfg = ModelConfig.from_hf(gguf_hf_config(qwen3_moe[1]))
    assert (cfg.arch, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.head_dim) == (
        "qwen3_moe", 8, 2, 24, 16)
    assert cfg.norm_topk_prob and cfg.moe_layers == [0, 1, 2] and cfg.intermediate_size == 72 and cfg.qk_norm
    manifest = read_manifest(converted)
    assert ModelConfig.from_dict(manifest["model_config"]) == cfg and manifest["source"]["kind"] == "gguf"
    assert read_config(weight_source(qwen3_moe[1])) == cfg


def test_converted_gguf_logits_match_transformers(qwen3_moe, converted):
    """The converted checkpoint and the .gguf loaded directly: float32 logits of two 64-token prompts
    against the transformers model the file was written from."""
    hf, path = qwen3_moe
    ids = ids_of(L, seed=1, batch=2)
    with torch.no_grad():
        ref = hf(ids).logits
        for model in (load_model(converted), load_model(path)):
            assert rel(model(ids), ref) <= 1e-4, rel(model(ids), ref)


def test_greedy_tokens_from_gguf_match_transformers(qwen3_moe):
    """LLM("model.gguf"): 16 greedy tokens equal transformers' generate; each step's logits too."""
    hf, path = qwen3_moe
    ids = ids_of(L, seed=2)
    llm = LLM(path)
    llm.eos_ids = set()  # random weights may pick the end-of-text token; the 16 steps must all run
    ours = llm.generate(ids.tolist(), max_new_tokens=STEPS).token_ids
    assert len(ours) == STEPS
    with torch.no_grad():
        g = hf.generate(ids[None], attention_mask=torch.ones(1, L, dtype=torch.long), max_new_tokens=STEPS,
                        do_sample=False, output_logits=True, return_dict_in_generate=True, eos_token_id=None)
        assert g.sequences[0, L:].tolist() == ours
        full = llm.model(torch.tensor([ids.tolist() + ours[:-1]]))[0, L - 1:]
    assert rel(full, torch.cat(g.logits)) <= 1e-4


def test_tokenizer_is_saved_from_the_gguf(qwen3_moe, converted):
    """The checkpoint's tokenizer is the one transformers builds from the GGUF's metadata (merges applied,
    the control token whole)."""
    text = "the cat in the hat<|endoftext|>"
    want = transformers.AutoTokenizer.from_pretrained(qwen3_moe[1].parent, gguf_file=qwen3_moe[1].name)(text).input_ids
    got = transformers.AutoTokenizer.from_pretrained(converted)(text).input_ids
    assert got == want and want[-1] == EOS and TOKENS.index("he") in want


def test_tp2_shards_from_gguf(qwen3_moe, converted, tmp_path):
    """--tp 2 shards of the GGUF merge back to the tp=1 checkpoint, and each rank's shard equals what a
    tp=2 run reads from the .gguf itself (rank_state: config, then this rank's slices)."""
    ckpt = convert(out=tmp_path / "tp2", gguf=qwen3_moe[1], tp=2, dtype="float32", progress=False)
    one, two = load_model(converted).state_dict(), load_model(ckpt).state_dict()
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    cfg = read_config(weight_source(qwen3_moe[1]))
    manifest = read_manifest(ckpt)
    for r in range(2):
        shard = load_shard(ckpt, manifest, r, 0)
        direct = rank_state(weight_source(qwen3_moe[1]), cfg, TPShard(cfg, 2, r), [0, 1, 2], True, True, 0,
                            torch.float32, "cpu")
        assert shard.keys() == direct.keys() and all(torch.equal(shard[k], direct[k]) for k in shard), r
        assert shard["layers.0.feed_forward.experts.w13"].shape == (8, 24, 48)  # 12 of 24 gate + 12 up rows


def test_gguf_missing_a_tensor_is_refused(qwen3_moe, tmp_path):
    """A file without one of the model's tensors is refused (transformers would keep random weights)."""
    path = write_gguf(qwen3_moe[0], tmp_path / "q.gguf", skip={"blk.1.attn_q_norm.weight"})
    with pytest.raises(ValueError, match=r"q.gguf: transformers' GGUF reader left 1 weights of Qwen3MoeForCausalLM "
                                         r"unread \(model.layers.1.self_attn.q_norm.weight, ...\).*--hf DIR"):
        convert(out=tmp_path / "out", gguf=path, progress=False)
    assert not (tmp_path / "out").exists()


def test_transformers_too_old_is_refused(qwen3_moe, tmp_path, monkeypatch):
    """A transformers whose GGUF reader has no Qwen3-MoE mapping (before 4.56): the error names the version."""
    from transformers.integrations import ggml

    monkeypatch.delitem(ggml.GGUF_CONFIG_MAPPING, "qwen3_moe")
    with pytest.raises(UnsupportedArchitectureError, match=r"qwen3-moe.gguf: transformers \S+'s GGUF reader does "
                       r"not read qwen3_moe .*needs transformers >= 4.56: pip install -U 'transformers>=4.56', or "
                       r".*--hf DIR"):
        convert(out=tmp_path / "out", gguf=qwen3_moe[1], progress=False)


def test_other_moe_gguf_architectures_are_refused(qwen3_moe, tmp_path):
    """An MoE architecture starshard does not read from GGUF (here qwen2moe: shared experts) is refused
    from its metadata, naming the architecture and the fix."""
    path = write_gguf(qwen3_moe[0], tmp_path / "q2.gguf", arch="qwen2moe")
    with pytest.raises(UnsupportedArchitectureError, match=r"q2.gguf: GGUF files of the mixture-of-experts "
                       r"architecture 'qwen2moe' \(8 experts\) are not supported: .* for qwen3moe only; .*--hf DIR"):
        convert(out=tmp_path / "out", gguf=path, progress=False)


def test_moe_gguf_with_rope_scaling_is_refused(qwen3_moe, tmp_path):
    """YaRN in the metadata (transformers' reader maps no rope.scaling key for qwen3moe) is refused, not
    run with plain RoPE."""
    path = write_gguf(qwen3_moe[0], tmp_path / "y.gguf", yarn=(4.0, 64))
    with pytest.raises(UnsupportedArchitectureError, match=r"y.gguf: the file's RoPE scaling \(qwen3moe.rope.scaling"
                       r".type = 'yarn'\) is not read by transformers' GGUF reader.*--hf DIR"):
        convert(out=tmp_path / "out", gguf=path, progress=False)


@pytest.mark.slow
def test_tp2_and_pp2_runs_from_gguf(qwen3_moe):
    """LLM("model.gguf") over 2 gloo ranks, tp=2 and pp=2 (chunked prefill): the same greedy and sampled
    tokens and teacher-forced logits as one process."""
    from tests.parallel.test_parallel_runtime import run_layouts

    layouts = [{"name": "gguf-tp2", "path": qwen3_moe[1], "parallel": {"tp": 2}},
               {"name": "gguf-pp2", "path": qwen3_moe[1], "parallel": {"pp": 2}, "chunk": 16}]
    results = run_layouts(layouts, 2, ids_of(L, seed=3))
    assert [r[1]["layers"] for r in results] == [[0, 1], [2]]
