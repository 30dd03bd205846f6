"""Gemma 2 / 3 on gloo ranks equal one process: tp=2 (heads split, each
rank's local layers keep their window, Gemma's norms and soft-caps whole on every rank, the vocabulary
split under the final soft-cap) and pp=2 with a chunked prefill (a stage's layers keep their global
kinds), prompts of 80 tokens past a window of 16 (test_parallel_runtime's harness: greedy and sampled
tokens and teacher-forced logits)."""
import pytest
import torch
import transformers
from tests.helpers.hf_models import make_hf_model
from tests.parallel.test_parallel_runtime import run_layouts

transformers.logging.set_verbosity_error()

W = 16
L = 80


@pytest.mark.slow
def test_tp2_and_pp2_with_windows(tmp_path):
    kw = dict(eos_token_id=None, initializer_range=0.1, sliding_window=W)
    _, g2 = make_hf_model("gemma2", tmp_path / "g2", query_pre_attn_scalar=10, attn_logit_softcapping=2.0,
                          final_logit_softcapping=3.0, **kw)
    _, g3 = make_hf_model("gemma3", tmp_path / "g3", num_hidden_layers=4, sliding_window_pattern=3, **kw)
    ids = torch.randint(0, 211, (L,), generator=torch.Generator().manual_seed(6))
    layouts = [
        {"name": "gemma2-tp2", "path": g2, "parallel": {"tp": 2}},
        {"name": "gemma3-tp2", "path": g3, "parallel": {"tp": 2}},
        {"name": "gemma3-pp2", "path": g3, "parallel": {"pp": 2}, "chunk": 24},
    ]
    run_layouts(layouts, 2, ids)
