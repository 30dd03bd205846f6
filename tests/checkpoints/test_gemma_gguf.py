"""A Gemma 3 GGUF (llama.cpp's `gemma3` architecture and tensor names, norms stored as 1 + weight, the
sliding window in the metadata, no layer types: transformers' reader fills the default pattern of five
local layers per global one) read through transformers' GGUF reader: starshard's logits equal the
transformers model's. The shape of the real Gemma 3 270M file (window 512, head_dim 256, 4 heads / 1 KV
head, 18 layers) in miniature."""
import gguf
import torch
import transformers
from tests.helpers.hf_models import make_hf_model

from starshard.checkpoints.convert import convert, gguf_hf_config
from starshard.checkpoints.load import load_model

transformers.logging.set_verbosity_error()

W = 16
ROPE = {"full_attention": {"rope_type": "default", "rope_theta": 20000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}


def write_gemma3_gguf(model, path):
    c, state = model.config, model.state_dict()
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_name("tiny-gemma3")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(ROPE["full_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_sliding_window(c.sliding_window)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    toks = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"t{i}" for i in range(c.vocab_size - 4)]
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores([0.0] * 4 + [-float(i) for i in range(len(toks) - 4)])
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.UNKNOWN]
                      + [gguf.TokenType.NORMAL] * (len(toks) - 4))
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)

    def put(name, t, norm=False):
        w.add_tensor(name, t.detach().float().numpy() + (1.0 if norm else 0.0))  # llama.cpp: Gemma norms as 1 + w

    put("token_embd.weight", state["model.embed_tokens.weight"])
    put("output_norm.weight", state["model.norm.weight"], norm=True)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for ours, theirs in [("attn_norm", "input_layernorm"), ("post_attention_norm", "post_attention_layernorm"),
                             ("ffn_norm", "pre_feedforward_layernorm"), ("post_ffw_norm", "post_feedforward_layernorm"),
                             ("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm")]:
            put(f"blk.{i}.{ours}.weight", state[p + theirs + ".weight"], norm=True)
        for ours, theirs in [("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"),
                             ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                             ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj")]:
            put(f"blk.{i}.{ours}.weight", state[p + theirs + ".weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gemma3_gguf_matches_transformers(tmp_path):
    hf, _ = make_hf_model("gemma3", tmp_path / "hf", initializer_range=0.1, eos_token_id=None, num_hidden_layers=7,
                          sliding_window=W, max_position_embeddings=256, num_key_value_heads=1, rope_parameters=ROPE)
    path = write_gemma3_gguf(hf, tmp_path / "tiny-gemma3.gguf")
    hf_cfg = gguf_hf_config(path)
    assert hf_cfg["model_type"] == "gemma3_text" and hf_cfg["sliding_window"] == W
    ids = torch.randint(0, 211, (1, 80), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
    for model in (load_model(path), load_model(convert(out=tmp_path / "ckpt", gguf=path, dtype="float32",
                                                       progress=False))):
        cfg = model.config
        assert cfg.arch == "gemma3" and [cfg.layer_window(i) for i in range(7)] == [W] * 5 + [None, W]
        assert (cfg.local_rope_theta, cfg.rope_theta, cfg.num_kv_heads) == (10000.0, 20000.0, 1)
        with torch.no_grad():
            out = model(ids)
        assert ((out - ref).norm() / ref.norm()).item() <= 1e-4
