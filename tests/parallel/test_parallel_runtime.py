"""Tensor and pipeline parallel runs on spawned gloo ranks against the single-process reference:
same logits (fp32 rel. error <= 1e-4) and greedy tokens; Megatron rank order; layouts refused before
any collective; the torchrun CLI on the embedded default; the benchmark's CPU path."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers.hf_models import make_hf_model
from tests.helpers.mp_harness import run_ranks
from starshard.checkpoints.convert import convert
from starshard.checkpoints.load import CheckpointError
from starshard.config import ParallelConfig, SamplingConfig
from starshard.llm import LLM
from starshard.parallel.tensor import VocabShard, vocab_parallel_sample
from starshard.parallel.topology import LayoutError, _first_slurm_host, check_layout, megatron_coords, read_launch_env

ROOT = Path(__file__).resolve().parents[2]
STEPS = 5
SAMPLING = dict(temperature=0.9, top_k=20, top_p=0.9, seed=3)


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ---------------------------------------------------------------------------- reference
def reference(path, ids, random_weights=None):
    """Single-process greedy tokens, sampled tokens, and teacher-forced logits of ids + tokens."""
    llm = LLM(path, random_weights=random_weights)
    toks = llm.generate(ids.tolist(), max_new_tokens=STEPS).token_ids
    sampled = llm.generate(ids.tolist(), max_new_tokens=STEPS, **SAMPLING).token_ids
    with torch.no_grad():
        logits = llm.model(torch.cat([ids, torch.tensor(toks[:-1])])[None])[0]
    return toks, sampled, logits


def layout_rank(rank, world, ids, ref_tokens, layouts):
    """Each layout: greedy + sampled generation, teacher-forced logits (chunked prefill, then decode
    steps), the topology's coordinates and groups."""
    out = []
    for lay in layouts:
        llm = LLM(lay["path"], parallel=ParallelConfig(**lay["parallel"]), random_weights=lay.get("random"))
        runner, topo, chunk = llm.runner, llm.topology, lay.get("chunk")
        r = {"tokens": llm.generate(ids.tolist(), max_new_tokens=STEPS, prefill_chunk=chunk).token_ids,
             "sampled": llm.generate(ids.tolist(), max_new_tokens=STEPS, **SAMPLING).token_ids,
             "coords": topo.coords, "groups": {k: getattr(topo, f"{k}_ranks") for k in ("tp", "pp", "cp", "dp")},
             "kv_heads": llm.model.layers[0].attention.n_kv_heads, "layers": llm.model.layer_ids}
        cache = runner.new_cache(len(ids) + STEPS)
        with torch.inference_mode():
            rows = [runner.logits(ids[None], cache, chunk=chunk, last_only=False)]
            for t in ref_tokens[lay["name"]][:-1]:
                rows.append(runner.logits(torch.tensor([[t]]), cache))
        r["logits"] = None if rows[0] is None else torch.cat(rows, dim=1)[0]
        out.append(r)
    return out


def check(results, layouts, refs, world):
    for i, lay in enumerate(layouts):
        toks, sampled, logits = refs[lay["name"]]
        p = lay["parallel"]
        tp, pp = p.get("tp", 1), p.get("pp", 1)
        per_rank = [res[i] for res in results]
        for rank, r in enumerate(per_rank):
            assert r["tokens"] == toks, (lay["name"], rank)
            assert r["sampled"] == per_rank[0]["sampled"]  # every rank draws the same token
            if tp == 1:
                assert r["sampled"] == sampled  # pipeline-only runs sample exactly like one process
            want = megatron_coords(rank, tp, 1, world // (tp * pp), pp)
            assert r["coords"] == want
            assert r["groups"]["tp"] == [rank - rank % tp + j for j in range(tp)]
            assert r["groups"]["pp"] == [rank % (world // pp) + s * (world // pp) for s in range(pp)]
            if r["coords"]["pp"] == pp - 1:
                assert rel(r["logits"], logits) <= 1e-4, (lay["name"], rank, rel(r["logits"], logits))
            else:
                assert r["logits"] is None
        held = sorted({i for r in per_rank for i in r["layers"]})
        assert held == list(range(len(held)))


def run_layouts(layouts, world, ids):
    refs = {lay["name"]: reference(lay["path"], ids, lay.get("random")) for lay in layouts}
    results = run_ranks(layout_rank, world, ids, {k: v[0] for k, v in refs.items()}, layouts)
    check(results, layouts, refs, world)
    return results


def test_tp2_and_pp2(tmp_path):
    """tp=2 from converted shards (vocab 211 padded to 212), pp=2 from a HF dir with a 7-token
    prefill chunk, tp=2 on random weights (sliced per rank, equal to the one-process random model)."""
    _, hf = make_hf_model("llama", tmp_path, eos_token_id=None)
    ckpt = convert(out=tmp_path / "tp2", hf_dir=hf, tp=2, dtype="float32", progress=False)
    ids = torch.randint(0, 211, (29,), generator=torch.Generator().manual_seed(1))
    layouts = [
        {"name": "tp2-shards", "path": ckpt, "parallel": {"tp": 2}},
        {"name": "pp2-chunked", "path": hf, "parallel": {"pp": 2}, "chunk": 7},
        {"name": "tp2-random", "path": None, "random": "tiny", "parallel": {"tp": 2}},
    ]
    results = run_layouts(layouts, 2, ids)
    assert [r[0]["kv_heads"] for r in results] == [1, 1]
    assert [r[1]["layers"] for r in results] == [[0, 1], [2]]


def test_tp2_x_pp2_qwen2(tmp_path):
    """tp=2 x pp=2 (4 ranks): Qwen2 biases and tied embeddings (the last stage holds its own copy),
    uneven --pp-layers 1,2, chunked prefill."""
    _, hf = make_hf_model("qwen2", tmp_path, eos_token_id=None)
    ids = torch.randint(0, 211, (23,), generator=torch.Generator().manual_seed(2))
    layouts = [{"name": "tp2pp2", "path": hf, "parallel": {"tp": 2, "pp": 2, "pp_layers": [1, 2]}, "chunk": 8}]
    results = run_layouts(layouts, 4, ids)
    assert [r[0]["layers"] for r in results] == [[0], [0], [1, 2], [1, 2]]


def test_tp3_smollm2_shapes(tmp_path):
    """SmolLM2's head layout (9 heads, 3 KV heads): tp=3, one KV head per rank."""
    _, hf = make_hf_model("llama", tmp_path, num_attention_heads=9, num_key_value_heads=3, hidden_size=72,
                          eos_token_id=None)
    ids = torch.randint(0, 211, (19,), generator=torch.Generator().manual_seed(3))
    results = run_layouts([{"name": "tp3", "path": hf, "parallel": {"tp": 3}}], 3, ids)
    assert [r[0]["kv_heads"] for r in results] == [1, 1, 1]


# ---------------------------------------------------------------------------- vocab-parallel sampling
def _sample_rank(rank, world, logits, cfgs):
    n = -(-logits.shape[-1] // world)
    shard = VocabShard(rank * n, n, logits.shape[-1], dist.group.WORLD)
    padded = torch.nn.functional.pad(logits, (0, n * world - logits.shape[-1]))
    local = padded[:, rank * n : (rank + 1) * n]
    return [vocab_parallel_sample(local, shard, c, torch.Generator().manual_seed(5)).tolist() for c in cfgs]


def _gumbel_reference(logits, cfg, padded_vocab):
    """The same filtering as engine.sampling.sample on full logits, then the same Gumbel-max draw."""
    if cfg.temperature == 0:
        return logits.argmax(-1).tolist()
    x = logits / cfg.temperature
    if cfg.top_k:
        kth = x.topk(cfg.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if cfg.top_p < 1:
        p = x.softmax(-1)
        sp, idx = p.sort(-1, descending=True)
        drop = (sp.cumsum(-1) - sp >= cfg.top_p)
        x = x.masked_fill(torch.zeros_like(drop).scatter(-1, idx, drop), float("-inf"))
    noise = torch.empty(x.shape[0], padded_vocab).exponential_(generator=torch.Generator().manual_seed(5))
    return (x - noise[:, : x.shape[-1]].log()).argmax(-1).tolist()


def test_vocab_parallel_sampling_matches_full_vocab_draw():
    """Sharded greedy / top-k / top-p / temperature draws equal the same draw on the full logits;
    the 211-token vocabulary leaves padding on the last of 2 ranks."""
    logits = torch.randn(3, 211, generator=torch.Generator().manual_seed(0)) * 3
    logits[0, 17] = logits[0, 150] = logits[0].max() + 1  # a tie: the lower id wins, as torch.argmax
    cfgs = [SamplingConfig(), SamplingConfig(0.8), SamplingConfig(1.0, top_k=7), SamplingConfig(0.7, top_p=0.8),
            SamplingConfig(1.3, top_p=0.5, top_k=30)]
    got = run_ranks(_sample_rank, 2, logits, cfgs)
    want = [_gumbel_reference(logits, c, 212) for c in cfgs]
    assert got[0] == got[1] == want
    assert want[0][0] == 17


def test_vocab_sampling_distribution_single_rank():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    cfg = SamplingConfig(temperature=0.7, top_k=4)
    shard = VocabShard(0, 6, 6, None)
    gen = torch.Generator().manual_seed(0)
    draws = torch.tensor([int(vocab_parallel_sample(logits, shard, cfg, gen)) for _ in range(4000)])
    freq = torch.bincount(draws, minlength=6).float() / len(draws)
    want = torch.cat([(logits[0, :4] / 0.7).softmax(-1), torch.zeros(2)])
    assert (freq - want).abs().max() < 0.03


# ---------------------------------------------------------------------------- refused before any collective
@pytest.fixture
def world_env(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(k, raising=False)

    def set_world(n):
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", str(n))
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", "1")  # nothing listens: reaching a collective would fail or hang

    return set_world


def test_bad_layouts_are_refused_before_any_collective(tmp_path, world_env):
    _, smol = make_hf_model("llama", tmp_path, num_attention_heads=9, num_key_value_heads=3, hidden_size=72)
    world_env(2)
    with pytest.raises(LayoutError, match=r"tp=2 does not divide this model \(9 heads, 3 KV heads.*valid tp sizes: \[1, 3, 9\]"):
        LLM(smol, parallel=ParallelConfig(tp=2))
    with pytest.raises(LayoutError, match="pp=4 exceeds the model's 3 layers"):
        LLM(smol, parallel=ParallelConfig(pp=4))
    world_env(6)
    with pytest.raises(LayoutError, match=r"Ulysses needs the query heads .* 3, divisible by cp=2"):
        LLM(smol, parallel=ParallelConfig(tp=3, cp=2, cp_strategy="ulysses"))  # 3 local heads, 2 Ulysses ranks
    with pytest.raises(LayoutError, match=r"Ulysses needs the query heads .* 9, divisible by cp=6"):
        LLM(smol, parallel=ParallelConfig(cp=6, cp_strategy="ulysses"))
    with pytest.raises(LayoutError, match=r"Ulysses needs the query heads .* 3, divisible by cp=2"):
        LLM(smol, parallel=ParallelConfig(tp=3, cp=2, cp_strategy="usp", ulysses_degree=2))
    world_env(4)
    with pytest.raises(LayoutError, match=r"world size 4 is not a multiple of tp\*pp\*cp = 3\*1\*1 = 3"):
        LLM(smol, parallel=ParallelConfig(tp=3))
    with pytest.raises(LayoutError, match=r"world size 4 != tp\*pp\*cp\*dp = 1\*2\*1\*1 = 2"):
        LLM(smol, parallel=ParallelConfig(pp=2, dp=1))
    with pytest.raises(ValueError, match="gives 3 stages but --pp is 2"):
        ParallelConfig(pp=2, pp_layers=[1, 1, 1])
    assert not dist.is_initialized()


def test_checkpoint_of_another_layout_is_refused(tmp_path, world_env):
    _, hf = make_hf_model("llama", tmp_path)
    tp2 = convert(out=tmp_path / "tp2", hf_dir=hf, tp=2, dtype="float32", progress=False)
    pp2 = convert(out=tmp_path / "pp2", hf_dir=hf, pp=2, dtype="float32", progress=False)
    world_env(2)
    with pytest.raises(CheckpointError, match=r"converted for tp=2 pp=1, but this run uses tp=1 pp=2.*--tp 1 --pp 2"):
        LLM(tp2, parallel=ParallelConfig(pp=2))
    with pytest.raises(CheckpointError, match=r"splits the layers over stages as \[2, 1\].*--pp-layers 2,1"):
        LLM(pp2, parallel=ParallelConfig(pp=2, pp_layers=[1, 2]))
    assert not dist.is_initialized()


def test_launch_env_torchrun_and_slurm():
    assert _first_slurm_host("gpu[01-04,07],cpu1") == "gpu01"
    assert _first_slurm_host("node7") == "node7"
    assert _first_slurm_host("a-[3,5]") == "a-3"
    e = read_launch_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                         "SLURM_JOB_NODELIST": "h100-[12-13]", "SLURM_JOB_ID": "4242"})
    assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.source) == (5, 8, 1, "h100-12", "slurm")
    assert e.master_port == str(20000 + 4242)
    t = read_launch_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "MASTER_ADDR": "x", "MASTER_PORT": "7",
                         "SLURM_PROCID": "0", "SLURM_NTASKS": "1"})  # torchrun inside an allocation wins
    assert (t.rank, t.world_size, t.master_addr, t.source) == (3, 4, "x", "torchrun")
    assert read_launch_env({}).world_size == 1
    assert check_layout(ParallelConfig(tp=2, pp=2), 8) == 2
    assert [megatron_coords(r, 2, 1, 2, 2)["pp"] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


# ---------------------------------------------------------------------------- launchers
def _run(script, args, nproc=1, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, str(ROOT / "launch" / script)]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *cmd[1:]]
    return subprocess.run(cmd + args, capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.slow
def test_cli_tp3_on_embedded_default():
    """torchrun --nproc-per-node 3 launch/infer.py --tp 3 on the real SmolLM2-135M: the same tokens as
    one process; the tp=1 checkpoint is sliced in memory on each rank; only rank 0 prints."""
    args = ["--prompt", "Name three colors.", "--max-new-tokens", "6", "--json"]
    single = _run("infer.py", args)
    assert single.returncode == 0, single.stderr[-2000:]
    tp3 = _run("infer.py", args + ["--tp", "3"], nproc=3)
    assert tp3.returncode == 0, tp3.stderr[-3000:]
    a, b = (json.loads(p.stdout.strip().splitlines()[-1]) for p in (single, tp3))
    assert a["token_ids"] == b["token_ids"] and len(a["token_ids"]) == 6 and a["text"] == b["text"]
    assert len(tp3.stdout.strip().splitlines()) == 1


def test_cli_help_and_clear_refusal():
    h = _run("infer.py", ["--help"])
    for flag in ("--tp", "--pp", "--pp-layers", "--random-weights", "--prompt-len", "--dist-timeout", "srun"):
        assert flag in h.stdout
    bad = _run("infer.py", ["--random-weights", "smollm2-135m", "--prompt-len", "4", "--tp", "2"])
    assert bad.returncode != 0 and "valid tp sizes: [1, 3]" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_bench_tp_runs_on_cpu(tmp_path):
    out = tmp_path / "b.json"
    p = _run("bench.py", ["tp", "--random-weights", "tiny", "--device", "cpu", "--dtype", "float32", "--tp", "2",
                          "--lengths", "48,80", "--decode-steps", "3", "--repeats", "2", "--out", str(out)], nproc=2)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert (r["tp"], r["pp"], r["world_size"]) == (2, 1, 2)
    assert [row["length"] for row in r["results"]] == [48, 80]
    assert all(row["prefill_seconds"] > 0 and row["decode_tokens_per_second"] > 0 for row in r["results"])
    assert len(p.stdout.strip().splitlines()) == 1  # rank 0 only
