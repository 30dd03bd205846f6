"""serve's default budgets. --cache-gib on CUDA (commands/serve.py default_cache_bytes): planner.cache_budget with
the flags' chunk, batch and extend, the worst rank's over the group. The GPU's size and the weights' bytes are
stand-ins (no GPU here); the group is two gloo ranks. --disk-cache-gib (serving/tiers.py default_disk_budget):
a share of the free space, split over the ranks, capped."""
from collections import namedtuple
from types import SimpleNamespace

import pytest
import torch

from starshard.commands.serve import default_cache_bytes, parse_args
from starshard.config import ParallelConfig
from starshard.planner import GRAPH_POOL_BYTES, GiB, Layout, Workload, cache_budget
from starshard.serving.executor import TABLE_STORE_BYTES
from starshard.presets import preset_config
from starshard.serving import tiers
from starshard.serving.tiers import DISK_DEFAULT_CAP, DISK_FREE_SHARE, default_disk_budget
from tests.helpers.mp_harness import run_ranks

CUDA = torch.device("cuda")


def fake_llm(parallel: ParallelConfig):
    """What default_cache_bytes reads of an LLM: the config, the layout, the compute dtype."""
    norm = SimpleNamespace(weight=torch.zeros(1, dtype=torch.bfloat16))
    return SimpleNamespace(config=preset_config("llama-3.1-8b"), parallel=parallel,
                           model=SimpleNamespace(layers=[SimpleNamespace(attention_norm=norm)]))


def fake_gpu(monkeypatch, total: int, allocated: int):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=total))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: allocated)


def serve_args(argv, chunk):
    args = parse_args(argv)
    args.prefill_chunk = chunk  # serve's --prefill-chunk (0 / unset: the whole prompt)
    return args


def test_default_cache_bytes_one_rank(monkeypatch, caplog):
    total, weights = 80 * 10**9, 16 * 10**9
    fake_gpu(monkeypatch, total, weights)
    llm = fake_llm(ParallelConfig())
    W = llm.config.max_position_embeddings
    args = serve_args(["--max-batch", "8", "--max-extend", "1024"], 4096)
    with caplog.at_level("INFO", logger="starshard.serve"):
        got = default_cache_bytes(llm, args, CUDA, 4096)
    want = cache_budget(llm.config, Layout(), Workload(W, W, 0, 4096), total_bytes=total, weights_bytes=weights,
                        max_batch=8, max_extend=1024, graphs_bytes=GRAPH_POOL_BYTES + TABLE_STORE_BYTES)
    assert got == want.bytes > 50 * GiB
    assert f"context cache budget {want.describe()}" in caplog.text
    assert "step 0.53 GiB (one 4096-token chunk) - graphs 1.50 GiB" in caplog.text
    # no CUDA graphs: no pool or store kept for them
    assert default_cache_bytes(llm, serve_args(["--max-batch", "8", "--max-extend", "1024", "--no-cuda-graphs"],
                                               4096), CUDA, 4096) == got + GRAPH_POOL_BYTES + TABLE_STORE_BYTES
    # no chunk (0 or unset): a window-long prefill, which a 1M window leaves no room for
    for chunk in (0, None):
        with pytest.raises(ValueError, match=r"--cache-gib.*a whole 1048576-token prompt.*--prefill-chunk"):
            default_cache_bytes(llm, serve_args([], chunk), CUDA, chunk)
    assert default_cache_bytes(llm, serve_args([], 0), torch.device("cpu"), 0) == 2 * GiB  # the CPU's default


def _group_rank(rank, world, scenarios):
    """Each scenario's default_cache_bytes on this rank (or its refusal), with its weights' bytes."""
    out = []
    for allocated in scenarios:
        with pytest.MonkeyPatch.context() as mp:
            fake_gpu(mp, 80 * 10**9, allocated[rank])
            try:
                out.append(default_cache_bytes(fake_llm(ParallelConfig(cp=2, cp_strategy="ring")),
                                               serve_args([], 8192), CUDA, 8192))
            except ValueError as e:
                out.append(str(e))
    return out


def test_default_cache_bytes_worst_rank_over_the_group():
    # rank 1 holds 2 GB more: both ranks take its budget. Then its weights fill the card: both refuse.
    llm = fake_llm(ParallelConfig(cp=2, cp_strategy="ring"))
    W = llm.config.max_position_embeddings
    want = cache_budget(llm.config, Layout(cp=2, strategy="ring"), Workload(W, W, 0, 8192), total_bytes=80 * 10**9,
                        weights_bytes=18 * 10**9, max_batch=16, max_extend=4096,
                        graphs_bytes=GRAPH_POOL_BYTES + TABLE_STORE_BYTES).bytes
    (fit0, a), (fit1, b) = run_ranks(_group_rank, 2, [[16 * 10**9, 18 * 10**9], [16 * 10**9, 72 * 10**9]])
    assert fit0 == fit1 == want
    assert a.startswith("another rank has no memory left for the context cache (this rank:") and "--cache-gib" in a
    assert b.startswith("no memory is left for the context cache (--cache-gib):") and "weights 67.06 GiB" in b


Usage = namedtuple("Usage", "total used free")


def fake_disk(monkeypatch, free: int) -> list:
    """shutil.disk_usage as tiers sees it: `free` bytes free; -> the paths it was asked about."""
    asked = []
    monkeypatch.setattr(tiers.shutil, "disk_usage", lambda p: asked.append(p) or Usage(4 * free, 3 * free, free))
    return asked


def test_default_disk_budget(monkeypatch, tmp_path):
    asked = fake_disk(monkeypatch, 10 * GiB)
    assert DISK_FREE_SHARE == 0.5 and DISK_DEFAULT_CAP == 100 * GiB
    assert default_disk_budget(tmp_path, 1) == (5 * GiB, 10 * GiB)
    assert default_disk_budget(tmp_path / "not" / "yet", 4) == (1280 * 2**20, 10 * GiB)  # split over 4 ranks
    assert asked == [tmp_path, tmp_path]  # a directory still to be made: the filesystem that will hold it
    fake_disk(monkeypatch, 3 * GiB + 12345)
    assert default_disk_budget(tmp_path, 1)[0] == 1536 * 2**20  # whole MiB
    fake_disk(monkeypatch, 10 * 2**40)
    assert default_disk_budget(tmp_path, 8) == (DISK_DEFAULT_CAP, 10 * 2**40)  # 640 GiB each: capped
    fake_disk(monkeypatch, 2**20)
    with pytest.raises(ValueError, match=r"has 1 MiB free, too little for a disk tier; .*--disk-cache-gib"):
        default_disk_budget(tmp_path, 2)


def test_disk_cache_dir_alone_takes_the_default_budget(monkeypatch, tmp_path):
    fake_disk(monkeypatch, 10 * GiB)
    args = parse_args(["--disk-cache-dir", str(tmp_path / "kv")])
    assert args.tiers.disk_bytes == 5 * GiB and args.disk_free == 10 * GiB
    args = parse_args(["--disk-cache-dir", str(tmp_path / "kv"), "--disk-cache-gib", "2"])
    assert args.tiers.disk_bytes == 2 * GiB and args.disk_free is None  # the flag wins; nothing to log
