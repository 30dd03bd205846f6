"""Chunked prefill under the context strategies (--prefill-chunk with ring, ulysses, usp, star): the
first-token logits and the greedy decode after it equal the unchunked run (and, for the exact
strategies, the float32 dense single-process model); a prompt of L <= chunk is the unchunked run bit
for bit; each rank stores exactly StrategySpec.rank_rows(chunk=) rows; Star runs its anchor once per
document; APB refuses a chunk.

One spawn per world size runs every case of that size (spawning dominates the run time)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist

from tests.helpers.cp_ranks import dense_greedy
from tests.helpers.hf_models import make_hf_model
from tests.helpers.mp_harness import run_ranks
from starshard.checkpoints.load import load_model
from starshard.config import SamplingConfig
from starshard.parallel.context import make_strategy
from starshard.parallel.context.apb import APBAttention
from starshard.parallel.context.chunked import chunk_segment
from starshard.parallel.context.ring import RingAttention
from starshard.parallel.context.star import StarAttention
from starshard.parallel.context.ulysses import UlyssesAttention
from starshard.parallel.context.usp import UspAttention
from starshard.partition import prefill_steps, star_blocks, taper_align
from starshard.runtime.context_parallel import ContextParallelRunner
from starshard.runtime.generate import generate_tokens
from starshard.runtime.prompt import Prompt
from starshard.strategies import get_spec
from starshard.strategies.flops import prefill_knee

TOL = 1e-4  # the dense-reference tolerance of the exact tests (float32 on CPU)
STEPS = 6
EXACT = ("ring", "ulysses", "usp")


@dataclass(frozen=True)
class Case:
    strategy: str
    L: int
    chunk: int
    context: int | None = None  # Star's document part (default: the whole prompt)
    options: dict = field(default_factory=dict, hash=False)
    fp8: bool = False
    knee: int | None = None  # the steps' taper (partition.prefill_steps)

    @property
    def name(self) -> str:
        opts = "".join(f"-{k}{v}" for k, v in self.options.items())
        knee = f"-knee{self.knee}" if self.knee else ""
        return f"{self.strategy}-L{self.L}-chunk{self.chunk}{opts}{'-fp8' if self.fp8 else ''}{knee}"


CASES = {
    2: [
        Case("ring", 37, 8),  # odd L, a chunk that does not divide it
        Case("ring", 9, 1),  # chunks smaller than cp: a rank runs only padding
        Case("ring", 37, 40),  # L <= chunk: the unchunked run
        Case("ulysses", 37, 8),
        Case("ulysses", 11, 3),
        Case("ulysses", 37, 37),
        Case("usp", 37, 6, options={"ulysses_degree": 2}),
        Case("usp", 23, 5, options={"ulysses_degree": 1}),
        Case("star", 37, 4, context=32, options={"block_size": 8, "anchor_size": 8}),  # no padding: anchor count
        Case("star", 41, 5, context=35, options={"block_size": 9, "anchor_size": 3}),
        Case("star", 30, 7, context=27, options={"block_size": 6, "anchor_size": 10}),  # anchor past block 0
        Case("ring", 37, 8, fp8=True),
        Case("ring", 61, 16, knee=8),  # tapered: 16, 8, 8, then 4-row steps
        Case("star", 61, 16, context=55, options={"block_size": 28, "anchor_size": 6}, knee=6),
    ],
    4: [
        Case("usp", 37, 7, options={"ulysses_degree": 2}),
        Case("ring", 29, 5),
    ],
}


def _generate(model, strategy, case: Case, chunk, count_below: int | None):
    """Prefill (chunked or not) + greedy decode on this rank -> what the test compares."""
    runner = ContextParallelRunner(model, strategy, kv_fp8=case.fp8)
    logits, step = {}, [0]

    def sample(lg, sampling, gen):  # the sampling rank's logits of each token (the first: the prefill's owner)
        logits[step[0]] = lg[0].clone()
        return lg.argmax(-1)

    runner.sample = sample
    seen = [0]

    def count(module, args):  # layer 0's rows at positions below the anchor end (Star)
        seen[0] += int((args[3] < count_below).sum())

    hook = model.layers[0].register_forward_pre_hook(count) if count_below is not None else None
    context = case.context or case.L
    prompt = Prompt(_ids(case.L), context)
    knee = case.knee if chunk else None
    cache = runner.new_cache(case.L + STEPS, case.L, context, chunk, knee)
    capacity = cache.layer(0).capacity
    with torch.no_grad():
        tok = runner.prefill(prompt, cache, SamplingConfig(), None, chunk, knee)
        after_prefill = cache.length
        toks = [int(tok)]
        for i in range(1, STEPS):
            step[0] = i
            tok = runner.next_token(tok.view(1, 1), cache, SamplingConfig(), None)
            toks.append(int(tok))
    if hook is not None:
        hook.remove()
    return {"logits": logits, "tokens": toks, "after_prefill": after_prefill, "capacity": capacity,
            "final_capacity": cache.layer(0).capacity, "positions": cache.layer(0).view()[2][:after_prefill].clone(),
            "anchor_rows": seen[0],
            "rank_rows": strategy.rank_rows(case.L, context, chunk, knee),
            "steps": len(runner.prefill_bounds(case.L, context, chunk, knee))}


def _ids(L: int) -> list[int]:
    return torch.randint(0, 211, (L,), generator=torch.Generator().manual_seed(L)).tolist()



def _world(rank, world, path):
    model = load_model(path)
    out = {}
    for case in CASES[world]:
        anchor = case.options.get("anchor_size") if case.strategy == "star" else None
        res = {}
        for chunk in (None, case.chunk):
            strategy = make_strategy(case.strategy, dist.group.WORLD, cp_groups=[list(range(world))], **case.options)
            res[chunk] = _generate(model, strategy, case, chunk, anchor)
        out[case.name] = res
    case = CASES[world][0]  # infer's loop: generate_tokens sizes the shards
    strategy = make_strategy(case.strategy, dist.group.WORLD, cp_groups=[list(range(world))], **case.options)
    runner = ContextParallelRunner(model, strategy)
    made, new_cache = [], runner.new_cache

    def sized(*args, **kwargs):
        cache = new_cache(*args, **kwargs)
        made.append((cache, cache.layer(0).capacity))
        return cache

    runner.new_cache = sized
    g = generate_tokens(runner, Prompt(_ids(case.L), case.L), max_new_tokens=STEPS, sampling=SamplingConfig(),
                        eos_ids=set(), prefill_chunk=case.chunk)
    ((cache, capacity),) = made
    out["generate"] = {"tokens": g.tokens, "capacity": capacity, "final_capacity": cache.layer(0).capacity}
    return out


_RESULTS: dict = {}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    _, path = make_hf_model("llama", tmp_path_factory.mktemp("chunked"), eos_token_id=None)  # 6 heads, 2 KV heads
    return path


def _results(world: int, path):
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(_world, world, path)
    return _RESULTS[world]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _sampled_logits(results, name, chunk) -> list[torch.Tensor]:
    steps = {}
    for r in results:
        assert not steps.keys() & r[name][chunk]["logits"].keys()  # one rank samples each token
        steps |= r[name][chunk]["logits"]
    return [steps[i] for i in sorted(steps)]


def _dense(path, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
    return dense_greedy(path, ids, STEPS)


def _params(slow_worlds=(4,)):
    for world, cases in CASES.items():
        marks = [pytest.mark.slow] if world in slow_worlds else []
        for case in cases:
            yield pytest.param(world, case, id=f"cp{world}-{case.name}", marks=marks)


@pytest.mark.parametrize("world,case", list(_params()))
def test_chunked_equals_unchunked(model_path, world, case):
    results = _results(world, model_path)
    whole, chunked = _sampled_logits(results, case.name, None), _sampled_logits(results, case.name, case.chunk)
    assert len(whole) == len(chunked) == STEPS
    if case.L <= case.chunk:  # one step: the unchunked prefill itself
        assert all(torch.equal(a, b) for a, b in zip(whole, chunked))
    tol = 1e-2 if case.fp8 else TOL  # FP8: the unchunked ring attends its own block unquantized, chunks as stored
    for step, (a, b) in enumerate(zip(whole, chunked)):
        assert _rel(b, a) <= tol, (step, _rel(b, a))
    for r in results:
        assert r[case.name][case.chunk]["tokens"] == r[case.name][None]["tokens"] == results[0][case.name][None]["tokens"]
    if case.strategy in EXACT and not case.fp8:  # exact: also the float32 dense single-process run
        ref_first, ref_tokens = _dense(model_path, _ids(case.L))
        assert _rel(chunked[0], ref_first) <= TOL
        assert results[0][case.name][case.chunk]["tokens"] == ref_tokens


@pytest.mark.parametrize("world,case", list(_params()))
def test_rank_rows_are_what_each_rank_stores(model_path, world, case):
    results = _results(world, model_path)
    for chunk in (None, case.chunk):
        rows = [r[case.name][chunk]["after_prefill"] for r in results]
        assert rows == results[0][case.name][chunk]["rank_rows"]
        held = torch.cat([r[case.name][chunk]["positions"] for r in results]).sort().values
        assert held.tolist() == list(range(case.L))  # every prompt position once, never padding
        for r in results:  # allocated exactly: the shard never grew
            assert r[case.name][chunk]["capacity"] == r[case.name][chunk]["final_capacity"]


def test_tapered_cases_taper(model_path):
    """Guards the tapered cases above: their steps are fewer rows than the chunk after the knee."""
    results = _results(2, model_path)
    for case in CASES[2]:
        if case.knee is not None:
            uniform = len(get_spec(case.strategy).prefill_bounds(2, case.L, case.context or case.L, case.options,
                                                                 case.chunk))
            assert results[0][case.name][case.chunk]["steps"] > uniform, case.name


def test_star_runs_its_anchor_once_per_document(model_path):
    case = CASES[2][8]
    assert case.strategy == "star" and case.chunk % 4 == 0 and case.options["block_size"] % case.chunk == 0
    results = _results(2, model_path)
    anchor = case.options["anchor_size"]
    blocks = star_blocks(case.context, case.options["block_size"], 2)
    assert len(blocks[0]) > 1 and blocks[1]  # rank 0 holds later blocks too, rank 1 some
    # unchunked: block 0, and a copy of the anchor in every block of the ranks > 0 (rank 0 reads its later blocks'
    # from its cache: star.py); chunked: block 0's rows only
    assert sum(r[case.name][None]["anchor_rows"] for r in results) == (1 + len(blocks[1])) * anchor
    assert sum(r[case.name][case.chunk]["anchor_rows"] for r in results) == anchor


def test_star_chunked_is_star_not_dense(model_path):
    """Guards the comparison: these Star cases are an approximation that differs from dense."""
    results = _results(2, model_path)
    case = CASES[2][9]
    ref_first, _ = _dense(model_path, _ids(case.L))
    assert _rel(_sampled_logits(results, case.name, case.chunk)[0], ref_first) > 1e-3


def _as_rank(strategy, cp: int, rank: int, u: int = 1):
    """The strategy as CP rank `rank` of `cp` sees it (its layouts read only its rank and sizes)."""
    strategy.cp, strategy.rank, strategy.query_rank = cp, rank, cp - 1
    if isinstance(strategy, UspAttention):
        strategy.u, strategy.rd = u, cp // u
    return strategy


def _kept(strategy, L: int, context: int, chunk: int, knee: int | None = None) -> list[int]:
    """Positions one rank stores, from the runner's layouts (segments, chunk_segment), not the spec."""
    C = min(context, L - 1) if strategy.query_phase else L
    bounds = strategy.prefill_bounds(L, context, chunk, knee)
    if len(bounds) == 1:  # the unchunked prefill
        segs = strategy.segments(L, C)
    else:  # the first step is the strategy's own prefill of prompt[0:end] (Star's: the generic path)
        segs = [chunk_segment(s, min(e, C), strategy.cp, strategy.rank) if i or strategy.query_phase
                else strategy.segments(e, e)[0] for i, (s, e) in enumerate(bounds)]
    kept = []
    for seg in segs:
        rows = seg.cache_rows if seg.cache_rows is not None else torch.arange(len(seg.index))
        kept += [int(p) for p in seg.positions[rows]]
    if strategy.query_phase and strategy.is_query_rank:
        kept += list(range(C, L))
    return kept


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_rank_rows_follow_the_chunked_layout(cp):
    builds = [("ring", {}, lambda: RingAttention(None)), ("ulysses", {}, lambda: UlyssesAttention(None)),
              ("star", {"block_size": 7}, lambda: StarAttention(None, block_size=7)),
              ("star", {"anchor_size": 3}, lambda: StarAttention(None, anchor_size=3))]
    builds += [("usp", {"ulysses_degree": u}, lambda: UspAttention(None, 1, None, None))
               for u in range(1, cp + 1) if cp % u == 0]
    for name, options, build in builds:
        for L, context, chunk, knee in [(5, 4, 1, None), (37, 30, 3, None), (37, 30, 8, None), (61, 50, 16, None),
                                        (61, 61, 100, None), (61, 50, 16, 6), (97, 90, 24, 10)]:
            rows = get_spec(name).rank_rows(cp, L, context, {"query_rank": cp - 1} | options, chunk, knee)
            u = options.get("ulysses_degree", 1)
            kept = [_kept(_as_rank(build(), cp, r, u), L, context, chunk, knee) for r in range(cp)]
            assert rows == [len(k) for k in kept], (name, options, L, chunk, knee)
            assert sorted(p for k in kept for p in k) == list(range(L)), (name, options, L, chunk, knee)


def test_apb_refuses_a_chunk():
    apb = APBAttention(None, compressor="random")
    with pytest.raises(ValueError, match="apb prefills the whole prompt in one step.*drop --prefill-chunk"):
        apb.prefill_bounds(37, 30, 8)
    with pytest.raises(ValueError, match="drop --prefill-chunk"):
        get_spec("apb").rank_rows(2, 37, 30, {}, chunk=8)
    assert apb.prefill_bounds(37, 30, None) == [(0, 37)]
    assert not get_spec("apb").chunked_prefill
    assert all(get_spec(n).chunked_prefill for n in ("dense", "ring", "ulysses", "usp", "star"))


def test_star_steps_never_span_two_blocks():
    for L, C, chunk, block in [(41, 35, 5, 9), (37, 32, 4, 8), (30, 27, 7, 14)]:
        bounds = get_spec("star").prefill_bounds(2, L, C, {"block_size": block}, chunk)
        assert bounds[0][0] == 0 and bounds[-1][1] == L
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        for s, e in bounds:
            assert e - s <= chunk or e == L
            assert s // block == (min(e, C) - 1) // block  # one block per step (the question rides the last)


def test_planner_honours_the_chunk_for_context_strategies():
    from starshard.planner import Layout, Workload, plan_memory
    from starshard.presets import preset_config

    cfg = preset_config("llama-3.1-8b")
    L, C, N, chunk, cp = 131072, 131000, 64, 8192, 4
    for name in ("ring", "ulysses", "usp", "star"):
        whole = plan_memory(cfg, Layout(cp=cp, strategy=name), Workload(L, C, N)).worst
        chunked = plan_memory(cfg, Layout(cp=cp, strategy=name), Workload(L, C, N, chunk)).worst
        rows = get_spec(name).rank_rows(cp, L, C, {}, chunk)
        assert chunked.kv_tokens == max(n + (N if r == cp - 1 else 0) for r, n in enumerate(rows)), name
        assert chunked.rows == chunk // cp, name  # one chunk's zigzag shard per forward (the first step's too)
        assert chunked.activations < whole.activations / 4, name
    apb = Layout(cp=cp, strategy="apb")  # it runs the whole prompt in one step (the runner refuses a chunk)
    assert plan_memory(cfg, apb, Workload(L, C, N, chunk)).worst == plan_memory(cfg, apb, Workload(L, C, N)).worst


@pytest.mark.parametrize("case", [Case("star", 41, 6, context=35, options={"num_blocks": 3, "anchor_size": 4}),
                                  Case("ring", 23, 4), Case("ulysses", 23, 30)], ids=lambda c: c.name)
def test_one_rank(model_path, case):
    """A strategy studied on one rank (--cp 1 --cp-strategy star --num-blocks N) chunks the same way."""
    model = load_model(model_path)
    cls = {"star": StarAttention, "ring": RingAttention, "ulysses": UlyssesAttention}[case.strategy]
    whole, chunked = (_generate(model, cls(None, **case.options), case, chunk, None) for chunk in (None, case.chunk))
    assert whole["tokens"] == chunked["tokens"]
    for a, b in zip(whole["logits"].values(), chunked["logits"].values()):
        assert torch.equal(a, b) if case.L <= case.chunk else _rel(b, a) <= TOL
    assert [chunked["after_prefill"]] == chunked["rank_rows"] and chunked["capacity"] == chunked["final_capacity"]


def test_refusals(model_path):
    from types import SimpleNamespace

    model = load_model(model_path)
    with pytest.raises(ValueError, match="does not run with --pp > 1.*drop --prefill-chunk or run --pp 1"):
        ContextParallelRunner(model, RingAttention(None), link=SimpleNamespace(is_last=True)).prefill_bounds(37, 37, 8)
    runner = ContextParallelRunner(model, RingAttention(None))
    assert runner.prefill_bounds(37, 37, 40) == [(0, 37)]
    model.layers[1].attention.sparse = object()  # a sparse method on: only the whole prompt may run
    try:
        assert runner.prefill_bounds(37, 37, None) == [(0, 37)]
        with pytest.raises(ValueError, match="--sparse does not compose with --prefill-chunk"):
            runner.prefill_bounds(37, 37, 8)
    finally:
        model.layers[1].attention.sparse = None
    with pytest.raises(ValueError, match="must lie in one block of 8 tokens"):
        StarAttention(None, block_size=8).chunk_hidden(4, 12, 30)
    assert StarAttention(None, block_size=8, anchor_size=3).chunk_hidden(17, 24, 30) == (3, 16)



def test_generate_sizes_the_cache_for_the_chunked_layout(model_path):
    """generate_tokens (infer's loop) allocates each shard for the chunked layout (here one more row
    on rank 0 than unchunked): no shard grows, and the tokens are the chunked prefill's."""
    results = _results(2, model_path)
    case = CASES[2][0]
    rows = get_spec(case.strategy).rank_rows(2, case.L, case.L, {}, case.chunk)
    assert rows != get_spec(case.strategy).rank_rows(2, case.L, case.L, {})
    for rank, r in enumerate(results):
        g = r["generate"]
        assert g["capacity"] == g["final_capacity"] == rows[rank] + (STEPS if rank == 1 else 0)
        assert g["tokens"] == r[case.name][case.chunk]["tokens"]


def _cost(rows: int, held: int, knee: int) -> float:
    """The taper's cost model of a step (partition.prefill_steps), in token-linears."""
    return rows * (1 + (held + rows / 2) / knee)


@pytest.mark.parametrize("L,chunk,knee,cp", [(131072, 4096, 26624, 1), (524288, 16384, 26624, 4), (61, 16, 8, 2),
                                             (1000, 64, 100, 1), (997, 48, 30, 3)])
def test_tapered_steps(L, chunk, knee, cp):
    steps = prefill_steps(L, chunk, knee, cp)
    assert steps[0][0] == 0 and steps[-1][1] == L and all(a[1] == b[0] for a, b in zip(steps, steps[1:]))
    sizes = [e - s for s, e in steps]
    align = taper_align(chunk, cp)
    assert align % (2 * cp) == 0 and align <= max(2 * cp, chunk // 8)
    assert all(n % align == 0 for n in sizes[:-1])  # whole units (the chunks too, here); the last: what is left
    assert all(a >= b for a, b in zip(sizes, sizes[1:-1]))  # monotone non-increasing (the last: what is left)
    bound = _cost(chunk, knee, knee)  # a chunk-token step after K held tokens
    for (s, e), n in zip(steps, sizes):
        assert n <= chunk and (n == chunk or s > knee)  # full chunks up to the knee
        assert _cost(n, s, knee) <= bound * 1.01 or n == align, (s, n)  # the bound, unless the floor holds it
    assert len(steps) > len(prefill_steps(L, chunk, None, cp))  # the taper is in effect at these lengths
    assert prefill_steps(L, chunk, None, cp) == [(s, min(s + chunk, L)) for s in range(0, L, chunk)]


def test_taper_alignment():
    assert taper_align(4096, 1) == 256 and taper_align(16384, 4) == 1024  # 256 rows per CP rank
    assert taper_align(16, 2) == 4 and taper_align(5, 2) == 4  # small chunks: units of 2 x cp
    # a chunk smaller than the unit never tapers below itself
    assert prefill_steps(40, 3, 1, 2) == [(s, min(s + 3, 40)) for s in range(0, 40, 3)]
    with pytest.raises(ValueError, match="knee must be >= 1"):
        prefill_steps(40, 8, 0)


def test_prefill_knee():
    from starshard.presets import preset_config

    cfg = preset_config("llama-3.1-8b")
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    assert prefill_knee(cfg) == round(2 * (h * (q + 2 * kv) + q * h + 3 * h * inter) / (4 * q))  # 26624
    half = dataclasses.replace(cfg, sliding_window=4096,
                               layer_types=["sliding_attention", "full_attention"] * (cfg.num_layers // 2))
    assert prefill_knee(half) == 2 * prefill_knee(cfg)  # half the layers grow with the prefix
    local = dataclasses.replace(cfg, sliding_window=4096, layer_types=["sliding_attention"] * cfg.num_layers)
    assert prefill_knee(local) is None  # no layer grows: no taper


def test_tapered_star_steps_keep_block_cuts():
    for L, C, chunk, block, anchor, knee in [(41, 35, 5, 9, 3, 4), (200, 190, 16, 60, 20, 8),
                                             (200, 190, 16, 60, 60, 8)]:
        options = {"block_size": block, "anchor_size": anchor}
        bounds = get_spec("star").prefill_bounds(2, L, C, options, chunk, knee)
        assert bounds[0][0] == 0 and bounds[-1][1] == L and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        ends = {e for _, e in bounds}
        assert set(range(block, C, block)) <= ends  # every block end cuts
        for s, e in bounds:
            assert s // block == (min(e, C) - 1) // block and (e - s <= chunk or e == L)
            b0 = s // block * block  # the step sees the anchor and its block's earlier steps
            n = min(e, C) - s
            seen = min(anchor, b0) + s - b0
            assert n == min(chunk, C - s, block * (s // block + 1) - s) or seen > knee
