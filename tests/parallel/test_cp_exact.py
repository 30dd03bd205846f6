"""Exact context parallelism (ring, ulysses) through the whole model: logits and greedy tokens equal
the single-process dense run; the KV shards cover the prompt once; decode grows only the query rank."""
import pytest
import torch

from tests.helpers.cp_ranks import dense_greedy, strategy_rank
from tests.helpers.hf_models import make_hf_model
from tests.helpers.mp_harness import run_ranks
from starshard.parallel.context.ring import RingAttention, zigzag_positions
from starshard.parallel.context.ulysses import UlyssesAttention

STEPS = 32  # the issue: decode over a sharded cache equals dense decode for 32 tokens




def test_zigzag_covers_padded_sequence():
    for L, cp in [(61, 2), (61, 3), (8, 4), (5, 4)]:
        got = torch.cat([zigzag_positions(L, cp, r) for r in range(cp)]).sort().values
        assert got.tolist() == list(range(len(got))) and len(got) >= L and len(got) % (2 * cp) == 0


@pytest.mark.parametrize(
    "strategy,cp,heads,kv_heads,L",
    [
        ("ring", 2, 6, 2, 61),
        ("ring", 3, 6, 2, 61),
        ("ring", 4, 6, 2, 37),
        ("ring", 4, 6, 2, 5),  # more padding than a chunk
        ("ulysses", 2, 6, 2, 61),  # KV heads split
        ("ulysses", 3, 6, 2, 61),  # KV heads replicated
        ("ulysses", 3, 9, 3, 50),
    ],
)
def test_matches_dense(tmp_path, strategy, cp, heads, kv_heads, L):
    _, path = make_hf_model("llama", tmp_path, num_attention_heads=heads, num_key_value_heads=kv_heads,
                            hidden_size=8 * heads, eos_token_id=None)
    ids = torch.randint(0, 211, (L,), generator=torch.Generator().manual_seed(L + cp))
    ref_logits, ref_tokens = dense_greedy(path, ids, STEPS)
    make = {"ring": RingAttention, "ulysses": UlyssesAttention}[strategy]
    results = run_ranks(strategy_rank, cp, path, ids, L, make, STEPS)
    owner = results[0]["owner"]
    got = results[owner]["logits"]
    assert ((got - ref_logits).norm() / ref_logits.norm()).item() <= 1e-4
    for r in results:
        assert r["tokens"] == ref_tokens
    held = torch.cat([r["positions"] for r in results]).sort().values
    assert held.tolist() == list(range(L + STEPS - 1))  # every position once, no padding
    growth = [r["final"] - r["after_prefill"] for r in results]
    assert growth == [0] * (cp - 1) + [STEPS - 1]


def _ulysses_bad_heads(rank, world):
    import torch.distributed as dist

    s = UlyssesAttention(dist.group.WORLD)
    with pytest.raises(ValueError, match=r"divisible by cp=4; valid cp sizes: \[1, 2, 3, 6"):
        s.ulysses_attention(torch.zeros(1, 6, 2, 8), torch.zeros(1, 2, 2, 8), torch.zeros(1, 2, 2, 8))
    return True


def test_ulysses_refuses_heads_not_divisible_by_cp():
    assert all(run_ranks(_ulysses_bad_heads, 4))
