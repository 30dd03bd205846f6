"""Exact context-parallel attention cores (ring, ulysses, usp, merge over a group) on gloo ranks
against dense float64 attention of the whole sequence: every rank's real rows, out and lse.

One spawn per world size runs every case of that size (spawning dominates the run time); the
results are then checked case by case. Sharding and planning are also checked without processes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from tests.helpers.mp_harness import run_ranks
from starshard.kernels.attention import attention
from starshard.parallel.context.group_merge import merge_over_group
from starshard.parallel.context.ring import gather_ring_plan, plan_steps, ring_attention, zigzag_ring_plan
from starshard.parallel.context.sharding import (contiguous_positions, contiguous_shard, usp_positions, usp_shard,
                                                 zigzag_chunks, zigzag_positions, zigzag_shard)
from starshard.parallel.context.ulysses import kv_head_copies, ulysses_attention
from starshard.parallel.context.usp import new_usp_groups, usp_attention, usp_coords, usp_group_ranks, usp_ring_plan

D = 16
TOL = 1e-4


@dataclass(frozen=True)
class Case:
    fn: str  # ring | ulysses | usp | merge
    layout: str  # zigzag | contiguous | usp | scatter (random positions) | subq (ring: fewer query rows)
    L: int
    hq: int
    hkv: int
    B: int = 1
    u: int = 1  # usp: Ulysses degree
    plan: bool = False  # pass a precomputed plan (used twice)
    q_shift: int = 0  # query position = key position + shift: rows < -shift see nothing

    @property
    def name(self) -> str:
        extra = "".join(f"-{k}{v}" for k, v in (("B", self.B), ("u", self.u), ("shift", self.q_shift)) if v not in (1, 0))
        return f"{self.fn}-{self.layout}-L{self.L}-h{self.hq}x{self.hkv}{extra}{'-plan' if self.plan else ''}"


CASES = {
    2: [
        Case("ring", "zigzag", 37, 6, 2),
        Case("ring", "zigzag", 101, 9, 3, B=2, plan=True),
        Case("ring", "scatter", 37, 6, 2, q_shift=-3),
        Case("ring", "subq", 101, 6, 2),
        Case("ulysses", "contiguous", 37, 6, 2),  # KV heads split
        Case("ulysses", "contiguous", 101, 4, 1, B=2),  # KV heads repeated
        Case("ulysses", "zigzag", 101, 6, 3),
        Case("ulysses", "scatter", 37, 6, 2, q_shift=-3),
        Case("merge", "scatter", 37, 6, 2, q_shift=-2),
    ],
    3: [
        Case("ring", "zigzag", 37, 6, 2),
        Case("ring", "zigzag", 101, 9, 3, plan=True),
        Case("ring", "scatter", 101, 9, 3, plan=True, q_shift=-3),
        Case("ring", "subq", 37, 6, 2),
        Case("ulysses", "contiguous", 37, 6, 2),  # KV heads repeated (2 % 3)
        Case("ulysses", "contiguous", 101, 9, 3, B=2),  # KV heads split
        Case("ulysses", "scatter", 101, 6, 2, q_shift=-3),
        Case("ulysses", "contiguous", 5, 3, 1),
        Case("merge", "scatter", 101, 9, 3, q_shift=-2),
    ],
    4: [
        Case("ring", "zigzag", 37, 6, 2),
        Case("ring", "zigzag", 101, 9, 3, plan=True),
        Case("ring", "zigzag", 7, 6, 2),
        Case("ring", "zigzag", 3, 6, 2),  # padding fills whole shards
        Case("ring", "scatter", 101, 6, 2, q_shift=-3),
        Case("ulysses", "contiguous", 37, 8, 2),  # KV heads repeated twice
        Case("ulysses", "contiguous", 101, 12, 4),
        Case("ulysses", "contiguous", 5, 4, 1),  # the last rank holds only padding
        Case("usp", "usp", 37, 6, 2, u=2),
        Case("usp", "usp", 101, 4, 1, u=2, plan=True),
        Case("usp", "usp", 37, 6, 2, u=1, plan=True),
        Case("usp", "usp", 37, 8, 2, u=4),
        Case("usp", "scatter", 101, 6, 2, u=2, q_shift=-3),
        Case("merge", "scatter", 101, 6, 2, q_shift=-2),
    ],
}


def _tokens(case: Case, world: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(query tokens, key tokens) of this rank: indices into the global tensors; >= L is padding."""
    L = case.L
    if case.layout in ("zigzag", "subq"):
        k = zigzag_positions(L, world, rank)
    elif case.layout == "contiguous":
        k = contiguous_positions(L, world, rank)
    elif case.layout == "usp":
        ring_rank, uly_rank = usp_coords(rank, case.u)
        k = usp_positions(L, world // case.u, case.u, ring_rank, uly_rank)
    else:  # scatter: a random layout, the same on every rank
        n = math.ceil(L / world)
        k = torch.randperm(world * n, generator=torch.Generator().manual_seed(L)).view(world, n)[rank]
    return (k[: k.numel() // 2 + 1] if case.layout == "subq" else k), k


def _data(case: Case, total: int):
    g = torch.Generator().manual_seed(case.L * 31 + case.hq)
    q = torch.randn(case.B, case.hq, total, D, generator=g) * 2  # peaky softmax: lse matters
    k = torch.randn(case.B, case.hkv, total, D, generator=g)
    v = torch.randn(case.B, case.hkv, total, D, generator=g)
    return q, k, v


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _compare(case: Case, q_tok, out, lse, ref_out, ref_lse) -> dict:
    real = q_tok < case.L
    if not bool(real.any()):
        return {"rows": 0}
    got_o, got_l = out[:, :, real], lse[:, :, real]
    ref_o, ref_l = ref_out[:, :, q_tok[real]], ref_lse[:, :, q_tok[real]]
    empty = torch.isneginf(ref_l)
    return {
        "rows": int(real.sum()),
        "out": _rel(got_o, ref_o),
        "lse": _rel(got_l[~empty], ref_l[~empty]) if bool((~empty).any()) else 0.0,
        "empty_rows_ok": bool(torch.equal(torch.isneginf(got_l), empty)) and bool((got_o[empty] == 0).all()),
        "empty": int(empty.sum()),
        "dtype_ok": out.dtype == torch.float32 and lse.dtype == torch.float32,
    }


def _run_case(case: Case, rank: int, world: int, groups: dict) -> dict:
    q_tok, k_tok = _tokens(case, world, rank)
    total = world * k_tok.numel()
    qf, kf, vf = _data(case, total)
    L = case.L
    ref_out, ref_lse = attention(qf[:, :, :L].double(), kf[:, :, :L].double(), vf[:, :, :L].double(),
                                 q_pos=torch.arange(L) + case.q_shift, k_pos=torch.arange(L), causal=True)
    k_pos = k_tok.clone()
    q_pos = k_pos if q_tok is k_tok and case.q_shift == 0 else q_tok + case.q_shift  # self-attention: one tensor
    q, k, v = qf[:, :, q_tok], kf[:, :, k_tok], vf[:, :, k_tok]
    world_group = dist.group.WORLD
    if case.fn == "merge":  # every rank: all real queries over its keys, then merged
        q_tok = torch.arange(L)
        q_pos = q_tok + case.q_shift
        k_real = k_tok[k_tok < L]
        o, l = attention(qf[:, :, :L], kf[:, :, k_real], vf[:, :, k_real], q_pos=q_pos, k_pos=k_real, causal=True)
        out, lse = merge_over_group(o, l, world_group)
        return _compare(case, q_tok, out, lse, ref_out, ref_lse)
    runs = 2 if case.plan else 1
    for _ in range(runs):
        if case.fn == "ring":
            plan = None
            if case.plan:
                plan = zigzag_ring_plan(L, world_group) if case.layout == "zigzag" else gather_ring_plan(q_pos, k_pos, world_group)
            out, lse = ring_attention(q, k, v, q_pos, k_pos, world_group, plan=plan)
        elif case.fn == "ulysses":
            out, lse = ulysses_attention(q, k, v, q_pos, k_pos, world_group)
        else:
            ug, rg = groups[case.u]
            plan = usp_ring_plan(L, case.u, rg) if case.plan else None
            out, lse = usp_attention(q, k, v, q_pos, k_pos, ug, rg, ring_plan=plan)
    return _compare(case, q_tok, out, lse, ref_out, ref_lse)


def _errors(rank: int, world: int, groups: dict) -> dict:
    """Messages of the ValueErrors for query heads not divisible by the (Ulysses) group size."""
    msgs = {}
    bad = {2: 9, 3: 4, 4: 6}[world]
    x, kv = torch.zeros(1, bad, 2, D), torch.zeros(1, 1, 2, D)
    p = torch.arange(2) + 2 * rank
    for name, call in (("ulysses", lambda: ulysses_attention(x, kv, kv, p, p, dist.group.WORLD)),
                       ("usp", lambda: usp_attention(x, kv, kv, p, p, *groups[4], ring_plan=None))):
        if name == "usp" and world != 4:
            continue
        try:
            call()
            msgs[name] = None
        except ValueError as e:
            msgs[name] = str(e)
    return msgs


def _world(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    groups = {}
    if world == 4:  # every rank creates every subgroup, in the same order
        for u in (1, 2, 4):
            groups[u] = new_usp_groups([list(range(world))], u)
    results = {}
    for case in CASES[world]:
        try:
            results[case.name] = _run_case(case, rank, world, groups)
        except Exception as e:  # noqa: BLE001 - reported per case by the test
            results[case.name] = {"error": f"{type(e).__name__}: {e}"}
    results["errors"] = _errors(rank, world, groups)
    return results


_RESULTS: dict[int, list[dict]] = {}


def world_results(world: int) -> list[dict]:
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(_world, world)
    return _RESULTS[world]


@pytest.mark.parametrize("world,case", [(w, c) for w, cs in CASES.items() for c in cs],
                         ids=[f"cp{w}-{c.name}" for w, cs in CASES.items() for c in cs])
def test_matches_dense(world: int, case: Case):
    per_rank = [r[case.name] for r in world_results(world)]
    assert not [r for r in per_rank if "error" in r], per_rank
    checked = [r for r in per_rank if r["rows"]]
    assert sum(r["rows"] for r in per_rank) == (case.L if case.fn != "merge" else world * case.L) or case.layout == "subq"
    assert checked
    for r in checked:
        assert r["out"] <= TOL and r["lse"] <= TOL, per_rank
        assert r["empty_rows_ok"] and r["dtype_ok"], per_rank
    if case.q_shift:
        assert sum(r["empty"] for r in checked) > 0  # the case did exercise rows that see nothing


@pytest.mark.parametrize("world", sorted(CASES))
def test_ulysses_refuses_heads_not_divisible(world: int):
    bad, sizes = {2: (9, "[1, 3, 9]"), 3: (4, "[1, 2, 4]"), 4: (6, "[1, 2, 3, 6]")}[world]
    for r in world_results(world):
        for name, msg in r["errors"].items():
            assert msg is not None, name
            assert f"divisible by cp={world if name == 'ulysses' else 4}; valid cp sizes: {sizes}" in msg


# ---- no processes --------------------------------------------------------------------------------


@pytest.mark.parametrize("L", [1, 3, 5, 37, 101])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_shards_cover_sequence_once(L: int, cp: int):
    for shards in ([zigzag_shard(L, cp, r) for r in range(cp)], [contiguous_shard(L, cp, r) for r in range(cp)]):
        pos = torch.cat([s.positions for s in shards]).sort().values
        assert pos.tolist() == list(range(pos.numel()))  # padded sequence, every position once
        assert len({s.positions.numel() for s in shards}) == 1  # equal shards
        assert sum(s.num_valid for s in shards) == L
        real = torch.cat([s.positions[s.rows] for s in shards]).sort().values
        assert real.tolist() == list(range(L))  # no real token dropped
        for s in shards:
            assert bool((s.token_index < L).all()) and torch.equal(s.valid, s.positions < L)
    assert zigzag_chunks(L, cp)[1] % (2 * cp) == 0


@pytest.mark.parametrize("ring_degree,ulysses_degree", [(2, 2), (1, 4), (4, 1), (3, 2)])
def test_usp_shards_cover_sequence_once(ring_degree: int, ulysses_degree: int):
    for L in (5, 37, 101):
        shards = [usp_shard(L, ring_degree, ulysses_degree, *usp_coords(c, ulysses_degree))
                  for c in range(ring_degree * ulysses_degree)]
        assert sorted(torch.cat([s.positions for s in shards]).tolist()) == list(range(sum(s.positions.numel() for s in shards)))
        assert sum(s.num_valid for s in shards) == L
        # a ring rank's Ulysses group holds exactly its zigzag shard, in order
        n = shards[0].positions.numel() * ulysses_degree
        for i in range(ring_degree):
            held = torch.cat([s.positions for s in shards[i * ulysses_degree : (i + 1) * ulysses_degree]])
            assert torch.equal(held, zigzag_positions(n * ring_degree, ring_degree, i))


def test_sharding_rejects_bad_arguments():
    for bad in [(0, 2, 0), (10, 0, 0), (10, 2, 2), (10, 2, -1)]:
        with pytest.raises(ValueError):
            zigzag_positions(*bad)
        with pytest.raises(ValueError):
            contiguous_positions(*bad)


@pytest.mark.parametrize("L", [37, 64, 101])
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_zigzag_plan_balanced_and_mask_free(L: int, cp: int):
    pos = [zigzag_positions(L, cp, r) for r in range(cp)]
    work = []
    for r in range(cp):
        steps = plan_steps(pos[r], pos, r)
        assert len(steps[0]) in (1, 3)  # own block: causal diagonal(s) (+ one full block)
        assert all(len(s) == 1 for s in steps[1:])  # each remote block: half of it, one call
        assert all(not c.causal or c.diagonal for s in steps for c in s)  # never a general mask
        work.append(sum((c.q[1] - c.q[0]) * (c.k[1] - c.k[0]) for s in steps[1:] for c in s))
    assert len(set(work)) == 1  # remote work equal on every rank


def test_plan_skips_invisible_blocks():
    # rank 0 holds the early half, rank 1 the late half: rank 0 never needs rank 1's keys
    pos = [torch.arange(0, 8), torch.arange(8, 16)]
    assert plan_steps(pos[0], pos, 0)[1] == ()
    (call,) = plan_steps(pos[1], pos, 1)[1]
    assert not call.causal and call.q == (0, 8) and call.k == (0, 8)


def test_kv_head_copies_keep_gqa_groups():
    for hkv in range(1, 9):
        for g in range(1, 7):
            hq = hkv * g
            for cp in range(1, hq + 1):
                if hq % cp:
                    continue
                f = kv_head_copies(hq, hkv, cp)
                assert g % f == 0 and (hkv * f) % cp == 0
    assert kv_head_copies(6, 2, 2) == 1 and kv_head_copies(6, 2, 3) == 3 and kv_head_copies(8, 2, 4) == 2


def test_usp_group_ranks():
    assert usp_group_ranks([4, 5, 6, 7], 2) == ([[4, 5], [6, 7]], [[4, 6], [5, 7]])
    assert usp_group_ranks([3, 1, 2, 0], 4) == ([[0, 1, 2, 3]], [[0], [1], [2], [3]])
    with pytest.raises(ValueError, match="valid: \\[1, 2, 3, 6\\]"):
        usp_group_ranks(range(6), 4)
