"""The long-context families on gloo ranks equal one process: tp=2 (Phi-3's fused tensors and
Qwen3's q/k norms split per rank, from converted shards and from the HF dir), pp=2, and cp=2 under
ring (= dense) and Star (= Star's blocks run on one process), with the RoPE length set on every rank
(dynamic and longrope give each token its single-device frequencies whatever shard holds it)."""
import pytest
import torch
import torch.distributed as dist
import transformers
from tests.helpers.hf_models import make_hf_model
from tests.helpers.mp_harness import run_ranks
from tests.parallel.test_parallel_runtime import run_layouts

from starshard.checkpoints.convert import convert
from starshard.checkpoints.load import load_model
from starshard.config import SamplingConfig
from starshard.parallel.context.ring import RingAttention
from starshard.parallel.context.star import StarAttention
from starshard.runtime.context_parallel import ContextParallelRunner
from starshard.runtime.local import LocalRunner

transformers.logging.set_verbosity_error()

ORIG = 64
L = 200  # past the original window
CP_STEPS = 8
FAMILIES = {
    "qwen3-yarn": ("qwen3", dict(max_position_embeddings=256, rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIG))),
    "phi3-longrope": ("phi3", dict(max_position_embeddings=256, original_max_position_embeddings=ORIG,
                                   rope_scaling=dict(rope_type="longrope", short_factor=[1.0 + 0.1 * i for i in range(4)],
                                                     long_factor=[1.5 + 0.7 * i for i in range(4)]))),
    "llama-dynamic": ("llama", dict(max_position_embeddings=ORIG, rope_scaling=dict(rope_type="dynamic", factor=4.0))),
}


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    base = tmp_path_factory.mktemp("families")
    return {name: make_hf_model(arch, base / name, eos_token_id=None, initializer_range=0.1, **kw)[1]
            for name, (arch, kw) in FAMILIES.items()}


@pytest.mark.slow
def test_tp2_and_pp2(families, tmp_path):
    """tp=2 from converted shards (Phi-3's qkv_proj / gate_up_proj split per rank) and from the HF
    dir, pp=2 with a chunked prefill: the same greedy and sampled tokens and teacher-forced logits
    (rel. error <= 1e-4) as one process (test_parallel_runtime's harness)."""
    ids = torch.randint(0, 211, (L,), generator=torch.Generator().manual_seed(5))
    layouts = []
    for name, path in families.items():
        if name != "llama-dynamic":
            ckpt = convert(out=tmp_path / name, hf_dir=path, tp=2, dtype="float32", progress=False)
            layouts.append({"name": f"{name}-tp2-shards", "path": ckpt, "parallel": {"tp": 2}})
        else:
            layouts.append({"name": f"{name}-tp2-hf", "path": path, "parallel": {"tp": 2}})
        layouts.append({"name": f"{name}-pp2", "path": path, "parallel": {"pp": 2}, "chunk": 64})
    results = run_layouts(layouts, 2, ids)
    assert [r[1]["layers"] for r in results] == [[0, 1], [2]]


def _decode(runner, ids, context_len, steps):
    cache = runner.new_cache(len(ids) + steps)
    with torch.no_grad():
        logits, owner = runner.prefill_logits(ids, context_len, cache)
        tok = runner._broadcast_token(logits[:, -1].argmax(-1), owner)
        toks = [int(tok)]
        for _ in range(steps - 1):
            tok = runner.next_token(tok.view(1, 1), cache, SamplingConfig(), None)
            toks.append(int(tok))
    return {"logits": logits[0, -1], "owner": owner, "tokens": toks}


def _strategy(kind, group):
    return RingAttention(group) if kind == "ring" else StarAttention(group, num_blocks=None if group else 2)


def _run(path, ids, context_len, rope_length, kind, group):
    model = load_model(path)
    model.set_rope_length(rope_length)  # what the runtime sets on every rank: prompt + max new tokens
    return _decode(ContextParallelRunner(model, _strategy(kind, group)), ids, context_len, CP_STEPS)


def _cp_rank(rank, world, cases):
    return {(name, kind): _run(path, ids, C, R, kind, dist.group.WORLD)
            for name, path, ids, C, R in cases for kind in ("ring", "star")}


def _dense(path, ids, rope_length):
    """One process, no strategy: the last prompt token's logits and the greedy tokens."""
    model = load_model(path)
    model.set_rope_length(rope_length)
    cache = LocalRunner(model).new_cache(len(ids) + CP_STEPS)
    rows, x = [], ids[None]
    with torch.no_grad():
        for _ in range(CP_STEPS):
            rows.append(model(x, cache=cache, last_only=True)[0, -1])
            x = rows[-1].argmax().view(1, 1)
    return rows[0], [int(r.argmax()) for r in rows]


@pytest.mark.slow
def test_cp2_ring_and_star(families):
    """cp=2 on gloo. ring: the last prompt token's logits (rel. error <= 1e-4) and 8 greedy tokens
    equal the dense single-process run. Star (2 blocks, the query = the last 8 prompt tokens): equal
    to Star's two blocks run on one process (--num-blocks 2, rel. error <= 1e-5)."""
    cases = []
    for i, (name, path) in enumerate(families.items()):
        ids = torch.randint(0, 211, (L,), generator=torch.Generator().manual_seed(10 + i))
        cases.append((name, path, ids, L - 8, L + CP_STEPS))
    results = run_ranks(_cp_rank, 2, cases)
    for name, path, ids, C, R in cases:
        ref_logits, ref_tokens = _dense(path, ids, R)
        ring = [r[name, "ring"] for r in results]
        got = ring[ring[0]["owner"]]["logits"]
        assert ((got - ref_logits).norm() / ref_logits.norm()).item() <= 1e-4, name
        assert all(r["tokens"] == ref_tokens for r in ring), name
        star_ref = _run(path, ids, C, R, "star", None)
        for r in results:
            s = r[name, "star"]
            assert ((s["logits"] - star_ref["logits"]).norm() / star_ref["logits"].norm()).item() <= 1e-5, name
            assert s["tokens"] == star_ref["tokens"], name
