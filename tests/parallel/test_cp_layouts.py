"""Context parallelism composed with the rest of the engine, through LLM: tp x cp (ring, ulysses),
USP (Ulysses x ring), and sparse prefill (MInference) under dense / Ulysses. Each layout's prefill
logits and greedy tokens are compared with one process."""
import pytest
import torch

from tests.helpers.hf_models import make_hf_model
from tests.helpers.mp_harness import run_ranks
from starshard import LLM
from starshard.checkpoints.convert import convert
from starshard.checkpoints.load import CheckpointError
from starshard.config import ParallelConfig
from starshard.kernels.minference import AShape, Dense, MInferenceConfig, VerticalSlash
from starshard.kernels.sparse import SparseConfig

STEPS = 32


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def prefill_logits(llm: LLM, ids: torch.Tensor):
    """(full-vocab last-token logits on the owner CP rank, else None; owner)."""
    runner = llm.runner
    cache = runner.new_cache(len(ids) + 1)
    with torch.inference_mode():
        if not hasattr(runner, "prefill_logits"):  # one process, no strategy
            return llm.model(ids[None])[0, -1], 0
        logits, owner = runner.prefill_logits(ids, len(ids), cache)
    if runner.strategy.rank != owner or logits is None:  # logits live on the last pipeline stage
        return None, owner
    sampler = getattr(runner.sample, "vocab", None)
    if sampler is not None:  # tensor parallel: this rank holds a vocab shard
        from starshard.parallel.tensor import gather_logits

        logits = gather_logits(logits, sampler)
    return logits[0, -1], owner


def reference(path, ids, sparse=None):
    llm = LLM(path, sparse=sparse)
    return llm.generate(ids.tolist(), max_new_tokens=STEPS).token_ids, prefill_logits(llm, ids)[0]


def layouts_rank(rank, world, path, ids, layouts):
    out = []
    for lay in layouts:
        llm = LLM(path, parallel=ParallelConfig(**lay["parallel"]), sparse=lay.get("sparse"))
        tokens = llm.generate(ids.tolist(), max_new_tokens=STEPS).token_ids
        logits, owner = (None, None) if lay.get("tokens_only") else prefill_logits(llm, ids)
        out.append({"tokens": tokens, "logits": logits, "owner": owner, "coords": llm.topology.coords})
    return out


def check(results, layouts, refs):
    for i, lay in enumerate(layouts):
        ref_tokens, ref_logits = refs[i]
        per_rank = [res[i] for res in results]
        owners = [r for r in per_rank if r["logits"] is not None]
        # every TP rank of the owner CP rank (its last pipeline stage)
        assert len(owners) == (0 if lay.get("tokens_only") else lay["parallel"].get("tp", 1)), lay
        for r in owners:
            assert rel(r["logits"], ref_logits) <= 1e-4, (lay, rel(r["logits"], ref_logits))
        for r in per_rank:
            assert r["tokens"] == ref_tokens, lay


def test_tp_x_cp_and_usp(tmp_path):
    """tp=2 x cp=2 (ring, ulysses with one local KV head replicated) and USP cp=4 (2 Ulysses x 2
    ring, and 4 x 1) on 4 ranks, odd prompt length."""
    _, path = make_hf_model("llama", tmp_path, num_attention_heads=8, num_key_value_heads=2, hidden_size=64,
                            eos_token_id=None)
    ids = torch.randint(0, 211, (61,), generator=torch.Generator().manual_seed(5))
    layouts = [
        {"parallel": {"tp": 2, "cp": 2, "cp_strategy": "ring"}},
        {"parallel": {"tp": 2, "cp": 2, "cp_strategy": "ulysses"}},
        {"parallel": {"cp": 4, "cp_strategy": "usp", "ulysses_degree": 2}},
        {"parallel": {"cp": 4, "cp_strategy": "usp", "ulysses_degree": 1}},
    ]
    ref = reference(path, ids)
    results = run_ranks(layouts_rank, 4, path, ids, layouts)
    check(results, layouts, [ref] * len(layouts))
    # Megatron order: tp fastest, then cp.
    assert [r[0]["coords"]["tp"] for r in results] == [0, 1, 0, 1]
    assert [r[0]["coords"]["cp"] for r in results] == [0, 0, 1, 1]


def small_vs_config(tmp_path, vertical=6, slash=10, per_head=False):
    """Vertical-Slash on every head; per_head: every (layer, head) its own budgets and some heads
    A-shape / dense, so a rank that picks another rank's heads' patterns gets other logits."""
    layers = []
    if per_head:
        kinds = [lambda h: VerticalSlash(vertical + h, slash + 2 * h), lambda h: AShape(2 + h, 8 + h), lambda h: Dense()]
        layers = [{h: kinds[(h + li) % 3](h) for h in range(8)} for li in range(4)]
    cfg = MInferenceConfig(layers=layers, default=VerticalSlash(vertical, slash), block_size=16, last_q=16,
                           force_sink=2, force_local=3)
    f = tmp_path / "sparse.json"
    cfg.save(f)
    return SparseConfig("minference", str(f))


def test_sparse_prefill_composes_with_ulysses_and_tp(tmp_path):
    """A Vertical-Slash config small enough to drop keys: dense + sparse on one process is the
    reference; Ulysses cp=2 and tp=2 x Ulysses cp=2 give the same logits (each head sees its whole
    sequence after the all-to-all, so its pattern is the one-process pattern), and the sparse
    logits really differ from dense ones."""
    _, path = make_hf_model("llama", tmp_path, num_attention_heads=8, num_key_value_heads=2, hidden_size=64,
                            eos_token_id=None)
    ids = torch.randint(0, 211, (150,), generator=torch.Generator().manual_seed(6))
    sparse = small_vs_config(tmp_path, per_head=True)
    ref = reference(path, ids, sparse)
    dense = reference(path, ids)
    assert rel(ref[1], dense[1]) > 1e-3  # the pattern drops keys that matter
    layouts = [
        {"parallel": {"cp": 2, "cp_strategy": "ulysses"}, "sparse": sparse},
        {"parallel": {"tp": 2, "cp": 2, "cp_strategy": "ulysses"}, "sparse": sparse},
    ]
    check(run_ranks(layouts_rank, 2, path, ids, layouts[:1]), layouts[:1], [ref])
    check(run_ranks(layouts_rank, 4, path, ids, layouts[1:]), layouts[1:], [ref])


def test_sparse_with_full_budget_equals_dense(tmp_path):
    _, path = make_hf_model("llama", tmp_path, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                            eos_token_id=None)
    ids = torch.randint(0, 211, (97,), generator=torch.Generator().manual_seed(7))
    tokens, logits = reference(path, ids, small_vs_config(tmp_path, vertical=200, slash=200))
    ref_tokens, ref_logits = reference(path, ids)
    assert tokens == ref_tokens
    assert rel(logits, ref_logits) <= 1e-5


def test_sparse_with_ring_or_usp_is_refused_before_any_collective(tmp_path):
    from starshard.parallel.topology import LayoutError

    _, path = make_hf_model("llama", tmp_path, eos_token_id=None)
    for strategy in ("ring", "usp"):
        with pytest.raises(LayoutError, match=f"--sparse does not compose with --cp-strategy {strategy}"):
            LLM(path, parallel=ParallelConfig(cp=2, cp_strategy=strategy), sparse=small_vs_config(tmp_path))


def test_bad_ulysses_degree_and_sparse_config(tmp_path):
    with pytest.raises(ValueError, match=r"--ulysses-degree 3 must divide --cp 4; valid: \[1, 2, 4\]"):
        ParallelConfig(cp=4, cp_strategy="usp", ulysses_degree=3)
    with pytest.raises(ValueError, match="--sparse-config .* does not exist"):
        SparseConfig("minference", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="unknown --sparse 'flash'"):
        SparseConfig("flash")


def test_bench_prefill_with_sparse_runs_on_cpu(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "b.json"
    cmd = [sys.executable, str(Path(__file__).resolve().parents[2] / "launch" / "bench.py"), "prefill",
           "--random-weights", "tiny", "--lengths", "200", "--repeats", "1", "--device", "cpu", "--dtype", "float32",
           "--cp-strategy", "dense", "--sparse", "minference", "--decode-steps", "2", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    res = json.loads(out.read_text())
    assert res["args"]["sparse"] == "minference" and res["results"][0]["length"] == 200
    assert res["results"][0]["prefill_seconds"] > 0 and res["results"][0]["model_seconds"] > 0


def test_bench_prefill_apb_study_mode_reports_its_flop_model(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    from starshard.strategies.apb import apb_flops
    from starshard.strategies.flops import predicted_seconds
    from starshard.presets import preset_config

    out = tmp_path / "b.json"
    cmd = [sys.executable, str(Path(__file__).resolve().parents[2] / "launch" / "bench.py"), "prefill",
           "--random-weights", "tiny", "--lengths", "300", "--repeats", "1", "--device", "cpu", "--dtype", "float32",
           "--cp-strategy", "apb", "--apb-hosts", "4", "--anchor-size", "16", "--passing-size", "8",
           "--query-tokens", "20", "--decode-steps", "2", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    row = json.loads(out.read_text())["results"][0]
    peak = json.loads(out.read_text())["matmul_peak_tflops"] * 1e12
    want = predicted_seconds(apb_flops(preset_config("tiny"), 280, 4, 16, 8, query_len=20), peak, serial=True)
    assert row["model_seconds"] == pytest.approx(want, rel=1e-9)


def test_anchor_sparse_composes_with_ulysses(tmp_path):
    """--sparse anchor: an infinite threshold is dense; a small one drops keys, and Ulysses cp=2
    (each rank the whole sequence of half the heads) gives the one-process result."""
    _, path = make_hf_model("llama", tmp_path, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                            eos_token_id=None)
    ids = torch.randint(0, 211, (300,), generator=torch.Generator().manual_seed(8))
    dense = reference(path, ids)
    full = reference(path, ids, SparseConfig("anchor", anchor_theta=float("inf"), anchor_block_q=16, anchor_step=1))
    assert rel(full[1], dense[1]) <= 1e-5
    sparse = SparseConfig("anchor", anchor_theta=0.02, anchor_block_q=16, anchor_step=1)  # random weights: flat scores
    ref = reference(path, ids, sparse)
    assert rel(ref[1], dense[1]) > 1e-4
    layouts = [{"parallel": {"cp": 2, "cp_strategy": "ulysses"}, "sparse": sparse}]
    check(run_ranks(layouts_rank, 2, path, ids, layouts), layouts, [ref])


def test_pp_x_cp(tmp_path):
    """pp=2 x cp=2 on 4 ranks: ring and Ulysses (logits and 32 greedy tokens equal one process), Star
    with its default blocks (exact at cp=2: the second block's anchor is the whole first one) and APB
    through the query phase; an odd number of layers split 2 + 1."""
    _, path = make_hf_model("llama", tmp_path, num_attention_heads=8, num_key_value_heads=2, hidden_size=64,
                            eos_token_id=None)
    ids = torch.randint(0, 211, (61,), generator=torch.Generator().manual_seed(9))
    layouts = [
        {"parallel": {"pp": 2, "cp": 2, "cp_strategy": "ring"}},
        {"parallel": {"pp": 2, "cp": 2, "cp_strategy": "ulysses"}},
        {"parallel": {"pp": 2, "cp": 2, "cp_strategy": "star"}, "tokens_only": True},
        {"parallel": {"pp": 2, "cp": 2, "cp_strategy": "apb", "passing_size": 5}, "tokens_only": True},
    ]
    ref = reference(path, ids)
    # APB is approximate: its reference is APB's one-process study mode with 2 hosts (tested equal to cp=2).
    apb = LLM(path, parallel=ParallelConfig(cp_strategy="apb", apb_hosts=2, passing_size=5))
    ref_apb = (apb.generate(ids.tolist(), max_new_tokens=STEPS).token_ids, None)
    assert ref_apb[0] != ref[0]  # the approximation shows: the APB check is not the dense one again
    results = run_ranks(layouts_rank, 4, path, ids, layouts)
    check(results, layouts, [ref] * 3 + [ref_apb])
    assert [r[0]["coords"]["pp"] for r in results] == [0, 0, 1, 1]
    assert [r[0]["coords"]["cp"] for r in results] == [0, 1, 0, 1]


def test_cp_run_refuses_a_checkpoint_cut_for_pipeline_stages(tmp_path):
    """A cp-only run builds its ranks' weights from the checkpoint's shards as one stage: a checkpoint
    converted for pp=2 is refused before any collective, naming the layouts and the fix."""
    _, path = make_hf_model("llama", tmp_path)
    ckpt = convert(out=tmp_path / "ckpt", hf_dir=path, pp=2, dtype="float32", progress=False)
    with pytest.raises(CheckpointError, match=r"converted for tp=1 pp=2, but this run uses tp=1 pp=1"):
        LLM(ckpt, parallel=ParallelConfig(cp=2, cp_strategy="ring"))
