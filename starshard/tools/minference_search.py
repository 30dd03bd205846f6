"""Offline kernel-aware pattern search (MInference, Algorithm 1) -> per-head JSON config.

    python -m starshard.tools.minference_search --model M --out cfg.json [--length 8192] [--device cuda]

One sample prompt (a RULER-style multi-key retrieval task, sized in the model's tokens) runs through
the model once; each layer's attention is intercepted (its `attend` function is wrapped, then put
back) and, per query head, every candidate is scored by attention recall: the share of the dense
causal attention mass that the candidate's mask keeps, averaged over the rows of `--recall-blocks`
query row blocks spread over the last three quarters of the sample. Candidates have equal kernel
cost: the cost (score entries the Triton kernel
computes, `minference.kernel_cost`) of the target A-shape (`--target-sink`, `--target-local`; by
default the paper's 1024 + 4096 at 32K, scaled to the sample length); Vertical-Slash candidates fix
a share of that budget for vertical lines and grow the slash count to the target cost, Block-Sparse
grows its block count to it (bisection on the real index of the sample). With `--equal-cost` the best
recall wins.

By default (`--target-recall 0.99`) the search instead asks, per head, for the cheapest pattern whose
recall reaches R: each family's smallest budget reaching R (A-shape: the target's sink, the window grown;
Vertical-Slash: the same vertical shares, the diagonals grown; Block-Sparse: the block count grown),
then the lowest kernel cost among them; a head that no pattern brings to R runs dense. Equal-cost
search keeps the kernel time and lets recall fall where a head is spread out (the searched SmolLM2
config lost a quarter of the harness score; docs/results.md, Sparse prefill); a recall floor bounds what
each head gives up and lets the cost grow instead (SmolLM2, searched at 8K with 0.99: 0.99 of dense's
harness score and 4.76x dense at 128K; docs/results.md, Sparse prefill; hence the defaults).

`--recall-by block` asks the floor of every sampled query block's mean instead of the mean over all sampled
rows: the prompt's last block among them, the rows whose outputs give the answer's first token and which every
answer token reads (a mean over 16 blocks weighs them 1/16). On Qwen2.5-Coder-1.5B at 30K it kept the 4-hop
chain's answers the mean lost, for about the same budgets (docs/results.md, the Qwen section).

`--kinds` limits the pattern families a head may take (default all three; a head none reaches runs dense): a
multi-hop answer needs the few keys its hops read, rows a mean over sampled rows hardly weighs; Vertical-Slash
takes its columns from the prompt's last rows (the question's), Block-Sparse decides each query block alone.

With `--samples N` (tasks in turn from a comma-separated `--tasks`, depths spread) a head's pattern must reach the
floor on every sample: per family the largest of the samples' smallest budgets, then the cheapest family by its
highest cost over the samples.

Budgets are absolute token/block counts found at the sample length; like MInference's published
configs, they are applied unchanged at other lengths. `--published` also writes MInference's format.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import starshard
from starshard.checkpoints.named import resolve_model
from starshard.cli import add_rope_scaling_argument, parse_layer_ids
from starshard.evaluation.tasks import parse_tasks
from starshard.kernels import minference as mi
from starshard.runtime.prompt import load_tokenizer
from starshard.tools.layer_probe import layers_error, probe_layers, window_error
from starshard.tools.samples import sample_prompts

# Shares of the target's per-row budget given to vertical lines: the paper's Table 6 search space
# ((30, 2048), (100, 1800), (500, 1500), (3000, 200) around a 1024 + 4096 target) as fractions.
VERTICAL_SHARES = (0.006, 0.02, 0.1, 0.6)
KINDS = ("a_shape", "vertical_slash", "block_sparse")  # the pattern families (`kind`) a head may take (`--kinds`)
RECALL_BY = ("mean", "block")  # what reaches the floor: the mean over sampled rows, or each sampled block's mean
PAPER_TARGET = (1024, 4096, 32768)  # sink, local at this length


def parse_kinds(text: str) -> tuple[str, ...]:
    """`--kinds`: a comma-separated, non-empty subset of KINDS, in KINDS' order."""
    names = {t.strip() for t in text.split(",") if t.strip()}
    if not names or names - set(KINDS):
        bad = ", ".join(sorted(names - set(KINDS))) or "none"
        raise ValueError(f"--kinds: unknown or no pattern kind ({bad}); give one or more of {', '.join(KINDS)}")
    return tuple(n for n in KINDS if n in names)


def default_target(length: int) -> tuple[int, int]:
    sink, local, ref = PAPER_TARGET
    return max(1, round(sink * length / ref)), max(1, round(local * length / ref))


def _dense_probs(q, k, rows, *, offset, scale):
    """Causal softmax rows [Hq, len(rows), Lk] (float32) of the listed query rows of one batch row."""
    Hq, D = q.shape[1], q.shape[3]
    Hkv = k.shape[1]
    g = Hq // Hkv
    qs = q[0, :, rows].float().view(Hkv, g, rows.numel(), D)
    s = torch.einsum("hgrd,hkd->hgrk", qs, k[0].float()).reshape(Hq, rows.numel(), -1) * scale
    vis = torch.arange(k.shape[2], device=q.device)[None, :] <= (rows + offset)[:, None]
    return torch.softmax(s.masked_fill(~vis, float("-inf")), -1)


class LayerSearch:
    """Candidates for one layer's heads (batch row 0 of q/k) scored by attention recall: at equal kernel
    cost (`best`), or the cheapest reaching `target_recall` (`cheapest`)."""

    def __init__(self, q, k, *, block_size=64, last_q=64, force_sink=30, force_local=100, target=None,
                 recall_blocks=16, scale=None, vertical_aware=True, target_recall: float | None = None,
                 kinds: tuple[str, ...] = KINDS, recall_by: str = "mean"):
        self.q, self.k = q[:1], k[:1]
        self.Hq, self.Lq, self.D = q.shape[1], q.shape[2], q.shape[3]
        self.Lk = k.shape[2]
        self.BM = block_size
        self.last_q, self.force_sink, self.force_local = last_q, force_sink, force_local
        self.vertical_aware = vertical_aware
        if target_recall is not None and not 0.0 < target_recall <= 1.0:
            raise ValueError(f"target_recall must be in (0, 1], got {target_recall}")
        self.target_recall = target_recall
        self.kinds = parse_kinds(",".join(kinds))
        if recall_by not in RECALL_BY:
            raise ValueError(f"recall_by must be one of {', '.join(RECALL_BY)}, got {recall_by!r}")
        self.recall_by = recall_by
        self._estimates = {}
        self.offset = self.Lk - self.Lq
        self.scale = self.D**-0.5 if scale is None else scale
        self.target = target or default_target(self.Lk)
        nM = mi._cdiv(self.Lq, self.BM)
        first = nM // 4
        n = min(recall_blocks, nM - first)
        self.blocks = torch.linspace(first, nM - 1, n).round().long().unique().to(q.device)
        rows = self.blocks[:, None] * self.BM + torch.arange(self.BM, device=q.device)  # [blocks, BM]
        real = rows < self.Lq  # the last block may be partial
        self.probs = _dense_probs(self.q, self.k, rows[real], offset=self.offset, scale=self.scale)
        self.rows = int(real.sum())
        # each sampled row's block (an index into self.blocks): the block criterion sums rows by it
        self.row_block = torch.arange(len(self.blocks), device=q.device)[:, None].expand_as(rows)[real]
        self.block_rows = real.sum(1).float()
        self.heads = list(range(self.Hq))
        t_sink, t_local = self.target
        self.target_group = mi.HeadGroup("a_shape", self.heads, sink=[t_sink] * self.Hq, local=[t_local] * self.Hq)
        self.target_cost = self._cost(self.target_group)

    def _cost(self, grp) -> torch.Tensor:  # per head, on the CPU
        return mi.kernel_cost(grp, B=1, Lq=self.Lq, Lk=self.Lk, offset=self.offset, block_size=self.BM)[0].cpu()

    def _recall(self, grp) -> torch.Tensor:  # per head, on the CPU
        vis = mi.group_mask(grp, B=1, Lq=self.Lq, Lk=self.Lk, offset=self.offset, block_size=self.BM,
                            blocks=self.blocks)[0, :, : self.rows]
        kept = (self.probs * vis.to(self.probs.device)).sum(-1)  # [Hq, rows]: each row's kept attention mass
        if self.recall_by == "mean":
            return kept.mean(-1).cpu()
        sums = torch.zeros(self.Hq, len(self.blocks), device=kept.device).index_add_(1, self.row_block, kept)
        return (sums / self.block_rows).amin(-1).cpu()  # the lowest block: monotone in each budget, as the mean

    def vs_group(self, vertical: int, slash):
        """The index the runtime builds for these budgets (`vs_select`): with vertical_aware the slash
        scores leave out the chosen columns' echo, which depends on the slash budgets too."""
        if self.vertical_aware:
            v_idx, s_idx = mi.vs_select(self.q, self.k, offset=self.offset, vertical=vertical, slash=slash,
                                        last_q=self.last_q, force_sink=self.force_sink, force_local=self.force_local,
                                        scale=self.scale)
        else:
            if vertical not in self._estimates:  # MInference's raw scores depend on the vertical budget only
                vs, ss = mi.vs_scores(self.q, self.k, offset=self.offset, last_q=self.last_q, scale=self.scale)
                self._estimates[vertical] = (mi.pick_vertical(vs, vertical, min(self.last_q, self.Lq),
                                                              self.force_sink), ss)
            v_idx, ss = self._estimates[vertical]
            s_idx = mi.pick_slash(ss, slash, min(self.last_q, self.Lq), self.force_local, self.Hq)
        idx = mi.vs_index(v_idx, s_idx, Lq=self.Lq, Lk=self.Lk, offset=self.offset, block_size=self.BM)
        return mi.HeadGroup("vertical_slash", self.heads, index=idx)

    def bs_group(self, topk):
        idx = mi.bs_select(self.q, self.k, offset=self.offset, topk=torch.as_tensor(topk).tolist(),
                           block_size=self.BM, scale=self.scale)
        return mi.HeadGroup("block_sparse", self.heads, index=idx)

    def _grow(self, make, lo: int, hi: int):
        """Per head, the largest budget in [lo, hi] whose cost stays within the target (bisection;
        cost is non-decreasing in the budget up to chunk rounding). None where even `lo` costs more."""
        target = self.target_cost
        lo_t = torch.full((self.Hq,), lo, dtype=torch.long)
        hi_t = torch.full((self.Hq,), hi, dtype=torch.long)
        feasible = self._cost(make(lo_t)) <= target
        ok_hi = self._cost(make(hi_t)) <= target
        lo_t = torch.where(ok_hi, hi_t, lo_t)
        while True:
            open_ = (hi_t - lo_t > 1) & ~ok_hi & feasible
            if not open_.any():
                break
            mid = torch.where(open_, (lo_t + hi_t) // 2, lo_t)
            fits = self._cost(make(mid)) <= target
            lo_t = torch.where(open_ & fits, mid, lo_t)
            hi_t = torch.where(open_ & ~fits, mid, hi_t)
        return lo_t, feasible

    def candidates(self):
        """(pattern per head, recall per head, cost per head) of each family at the target's cost: A-shape the
        target itself, the others grown to their largest budget per head within its cost (recall -1 where even
        the family's lowest budget costs more)."""
        at_target = (torch.full((self.Hq,), self.target[1]), torch.ones(self.Hq, dtype=torch.bool))
        grown = [at_target if kind == "a_shape" else self._grow(make, lo, hi)
                 for kind, make, lo, hi, _ in self.families()]
        return floor_candidates(self.evaluate([b for b, _ in grown]), grown)

    def _smallest(self, make, lo: int, hi: int):
        """Per head, the smallest budget in [lo, hi] whose recall reaches target_recall (bisection;
        recall is non-decreasing in each family's budget: a larger budget keeps a superset), and
        whether even `hi` reaches it."""
        want = self.target_recall
        lo_t = torch.full((self.Hq,), lo, dtype=torch.long)
        hi_t = torch.full((self.Hq,), hi, dtype=torch.long)
        reach = self._recall(make(hi_t)) >= want
        at_lo = self._recall(make(lo_t)) >= want
        hi_t = torch.where(at_lo, lo_t, hi_t)
        while True:
            open_ = reach & ~at_lo & (hi_t - lo_t > 1)
            if not open_.any():
                break
            mid = torch.where(open_, (lo_t + hi_t) // 2, hi_t)
            good = self._recall(make(mid)) >= want
            hi_t = torch.where(open_ & good, mid, hi_t)
            lo_t = torch.where(open_ & ~good, mid, lo_t)
        return hi_t, reach

    def families(self):
        """(kind, index maker from per-head budgets, lowest budget, highest budget, pattern of a budget) of each
        family a search grows: A-shape (the target's sink, the window grown), Vertical-Slash (VERTICAL_SHARES of
        the target's keys per row as columns, the diagonals grown), Block-Sparse (the block count grown), those
        `kinds` names. Set by the target, the length and `kinds` alone, so samples of one length search the
        same families."""
        t_sink, t_local = self.target
        ndiag = self.Lq + self.offset

        def a_shape(local):
            return mi.HeadGroup("a_shape", self.heads, sink=[t_sink] * self.Hq, local=local.clamp(min=1).tolist())

        families = []
        if "a_shape" in self.kinds:
            families.append(("a_shape", a_shape, 1, self.Lk, lambda b: mi.AShape(t_sink, max(1, int(b)))))
        for share in VERTICAL_SHARES if "vertical_slash" in self.kinds else ():
            vert = max(1, min(self.Lk, round(share * (t_sink + t_local))))
            families.append(("vertical_slash", lambda s, v=vert: self.vs_group(v, s.tolist()), 0, ndiag,
                             lambda b, v=vert: mi.VerticalSlash(v, int(b))))
        if "block_sparse" in self.kinds:
            families.append(("block_sparse", lambda t: self.bs_group(t.clamp(min=1)), 1, mi._cdiv(self.Lk, self.BM),
                             lambda b: mi.BlockSparse(max(1, int(b)))))
        return families

    def smallest_budgets(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per family, (the smallest budget per head reaching target_recall, whether its highest does)."""
        return [self._smallest(make, lo, hi) for _, make, lo, hi, _ in self.families()]

    def evaluate(self, budgets: list[torch.Tensor]) -> list:
        """(pattern per head, recall per head, cost per head) of each family at these budgets per head."""
        out = []
        for (_, make, _, _, pattern), budget in zip(self.families(), budgets, strict=True):
            grp = make(budget)
            out.append(([pattern(b) for b in budget], self._recall(grp), self._cost(grp)))
        return out

    def recall_candidates(self) -> list:
        """(pattern per head, recall per head (-1 where the family cannot reach target_recall), cost
        per head) of each family at its smallest budget reaching target_recall."""
        found = self.smallest_budgets()
        return floor_candidates(self.evaluate([b for b, _ in found]), found)

    def cheapest(self) -> list:
        """Per head, the cheapest candidate (kernel cost) whose recall reaches target_recall; Dense
        where none does. The pattern's score is its recall (1.0 for Dense)."""
        return pick_cheapest(self.recall_candidates())

    def best(self) -> list:
        """Per head, the candidate with the best recall (its recall kept as the pattern's score); with
        target_recall, the cheapest one reaching it (`cheapest`)."""
        if self.target_recall is not None:
            return self.cheapest()
        cands = self.candidates()
        recalls = torch.stack([c[1] for c in cands])  # [C, Hq]
        pick = recalls.argmax(0)
        result = []
        for h in range(self.Hq):
            c = int(pick[h])
            p = cands[c][0][h]
            result.append(type(p)(**{**{f: getattr(p, f) for f in p.__dataclass_fields__ if f != "score"},
                                     "score": round(float(recalls[c, h]), 6)}))
        return result


def floor_candidates(scored, found) -> list:
    """`scored` (patterns, recall, cost per family, at the budgets of `found`: (budget, reached) per family) with
    recall -1 where the family's budget did not reach the floor (or the target's cost): what pick_cheapest reads."""
    return [(pats, torch.where(reach, rec, torch.tensor(-1.0)), cost)
            for (pats, rec, cost), (_, reach) in zip(scored, found, strict=True)]


def pick_cheapest(cands) -> list:
    """Per head, the cheapest of `cands` ((pattern per head, recall per head: -1 where the floor is not
    reached, cost per head) per family) by kernel cost; Dense where none reaches it. The pattern's score is its
    recall (1.0 for Dense)."""
    recalls = torch.stack([c[1] for c in cands])  # [C, Hq]
    costs = torch.stack([c[2].double() for c in cands])
    costs = torch.where(recalls >= 0, costs, torch.tensor(float("inf"), dtype=costs.dtype))
    pick = costs.argmin(0)
    result = []
    for h in range(recalls.shape[1]):
        c = int(pick[h])
        if not torch.isfinite(costs[c, h]):
            result.append(mi.Dense(score=1.0))
            continue
        p = cands[c][0][h]
        result.append(type(p)(**{**{f: getattr(p, f) for f in p.__dataclass_fields__ if f != "score"},
                                 "score": round(float(recalls[c, h]), 6)}))
    return result


def search_layer(q, k, **kwargs) -> list:
    """Best pattern per query head of one layer (q [B, Hq, L, D] after RoPE, k [B, Hkv, L, D])."""
    return LayerSearch(q, k, **kwargs).best()


def run_search(model, ids, *, layers=None, progress=True, **kwargs) -> list:
    """One forward pass; each selected layer's heads searched as its attention runs. Returns the
    per-layer list of {head: pattern} (empty dicts for layers not searched)."""
    found: list[dict] = [{} for _ in model.layers]

    def observe(i, q, k):
        t = time.time()
        found[i] = dict(enumerate(search_layer(q, k, **kwargs)))
        if progress:
            kinds = [p.kind for p in found[i].values()]
            summary = ", ".join(f"{kinds.count(x)} {x}" for x in sorted(set(kinds)))
            print(f"layer {i}: {summary} ({time.time() - t:.1f}s)", file=sys.stderr)

    probe_layers(model, ids, observe, layers)
    return found


def run_search_samples(model, samples: list[list[int]], *, layers=None, progress=True, **kwargs) -> list:
    """run_search's recall floor over several samples of one length: per head and family the largest of the
    samples' smallest budgets reaching the floor (a family's recall grows with its budget, so it reaches the
    floor on every sample), then, in a second pass, each family's recall (the lowest) and kernel cost (the
    highest) over the samples at that budget; the cheapest family per head, Dense where one sample's floor is
    out of a family's reach. Two forward passes per sample; nothing per sample is kept but budgets and scores."""
    if kwargs.get("target_recall") is None:
        raise ValueError("a search over several samples needs a recall floor (target_recall)")
    n = len(model.layers)
    budgets: list[list | None] = [None] * n  # per layer, per family: (budget per head, reached on every sample)
    scores: list[list | None] = [None] * n  # per layer, per family: (patterns, lowest recall, highest cost)

    def first(i, q, k):
        found = LayerSearch(q, k, **kwargs).smallest_budgets()
        if budgets[i] is None:
            budgets[i] = found
        else:
            budgets[i] = [(torch.maximum(b0, b), r0 & r) for (b0, r0), (b, r) in zip(budgets[i], found, strict=True)]

    def second(i, q, k):
        got = LayerSearch(q, k, **kwargs).evaluate([b for b, _ in budgets[i]])
        if scores[i] is None:
            scores[i] = got
        else:
            scores[i] = [(pats, torch.minimum(r0, r), torch.maximum(c0, c))
                         for (pats, r0, c0), (_, r, c) in zip(scores[i], got, strict=True)]

    for which, observe in (("budgets", first), ("scores", second)):
        for j, ids in enumerate(samples):
            t = time.time()
            probe_layers(model, ids, observe, layers)
            if progress:
                print(f"{which}: sample {j + 1} of {len(samples)} ({time.time() - t:.1f}s)", file=sys.stderr)
    found: list[dict] = [{} for _ in range(n)]
    for i in range(n):
        if scores[i] is not None:
            found[i] = dict(enumerate(pick_cheapest(floor_candidates(scores[i], budgets[i]))))
    return found


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="starshard minference-search", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="checkpoint dir, HF dir or .gguf (default: the embedded default model)")
    p.add_argument("--out", required=True, help="output JSON (starshard MInference config)")
    p.add_argument("--length", type=int, default=8192,
                   help="sample prompt length in tokens (the measured config used 8192; on a CPU a shorter sample "
                        "searches faster)")
    p.add_argument("--tasks", "--task", default="multikey",
                   help="harness task of the sample (starshard.evaluation.tasks); comma-separated: the samples' "
                        "tasks in turn, as anchor-calibrate's --tasks (--task: the earlier spelling)")
    p.add_argument("--samples", type=int, default=1,
                   help="sample prompts of --length tokens (default 1, the needle at half depth); more: the tasks in "
                        "turn, depths spread over (0, 1), seeds --seed, --seed + 1, ...; per head the cheapest "
                        "pattern whose recall reaches --target-recall on every sample (two passes a sample)")
    p.add_argument("--seed", type=int, default=0, help="seed of the (first) sample prompt (default 0)")
    p.add_argument("--layers", default=None, metavar="I,J,A-B",
                   help="layer ids or ranges to search, e.g. 0,5,10-14 (others get the default pattern; the forward stops after the last)")
    p.add_argument("--block-size", type=int, default=64,
                   help="rows and keys per block of the sparse kernels and of Block-Sparse's budget (default 64)")
    p.add_argument("--last-q", type=int, default=64,
                   help="last query rows whose attention estimates the Vertical-Slash index (default 64)")
    p.add_argument("--force-sink", type=int, default=30, help="first key columns always among the vertical lines")
    p.add_argument("--force-local", type=int, default=100, help="nearest diagonals always among the slash lines")
    p.add_argument("--minference-estimate", action="store_true",
                   help="MInference's raw slash estimate (default: leave out the chosen columns' echoes)")
    p.add_argument("--target-sink", type=int, default=None, help="target A-shape sink (default: 1024 scaled from 32K)")
    p.add_argument("--target-local", type=int, default=None, help="target A-shape window (default: 4096 scaled from 32K)")
    p.add_argument("--recall-blocks", type=int, default=16, help="query row blocks the recall is measured on")
    p.add_argument("--recall-by", choices=RECALL_BY, default="mean",
                   help="what must reach --target-recall: mean (default), the mean over the sampled rows; block, "
                        "each sampled query block's mean, the prompt's last block (the rows the answer is read "
                        "from) among them: it keeps multi-hop answers the mean loses (docs/parallelism.md)")
    p.add_argument("--kinds", default=",".join(KINDS),
                   help="comma-separated pattern kinds a head may take (default all: " + ", ".join(KINDS) +
                        "); a head none of them brings to the floor runs dense")
    p.add_argument("--target-recall", type=float, default=0.99,
                   help="pick per head the cheapest pattern whose attention recall reaches this (0 < R <= 1; a head "
                        "no pattern reaches runs dense; default 0.99, measured on SmolLM2: 0.99 of dense's harness score)")
    p.add_argument("--equal-cost", action="store_true",
                   help="instead pick per head the best recall at the target A-shape's kernel cost (MInference's "
                        "search; on SmolLM2 it kept 0.76 of dense's harness score)")
    add_rope_scaling_argument(p)  # a config for YaRN runs past the window is searched with YaRN
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the model runs (default: cuda where there is one, else cpu)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="the model's dtype (default bfloat16 on a GPU, as it runs, float32 on the CPU; the recall is "
                        "measured in float32)")
    p.add_argument("--published", default=None, help="also write MInference's published format to this path")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr (the summary line still prints)")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("float32" if torch.device(args.device).type == "cpu" else "bfloat16")
    if not 0.0 < args.target_recall <= 1.0:
        p.error(f"--target-recall must be in (0, 1], got {args.target_recall}")
    if args.samples < 1:
        p.error(f"--samples must be at least 1, got {args.samples}")
    if args.equal_cost:
        if args.samples > 1:
            p.error("--equal-cost searches one sample: drop --samples, or search with --target-recall")
        args.target_recall = None
    try:
        tasks = parse_tasks(args.tasks)
    except ValueError as e:
        p.error(str(e))
    try:
        kinds = parse_kinds(args.kinds)
    except ValueError as e:
        p.error(str(e))
    layers = parse_layer_ids(args.layers)  # a malformed list is refused before the model loads


    path = resolve_model(args.model, progress=not args.quiet)[0]  # a GGUF or a model by name: converted once
    model = starshard.load_model(path, dtype=getattr(torch, args.dtype), device=args.device,
                                rope_scaling=args.rope_scaling)
    if (error := layers_error(layers, len(model.layers))) is not None:
        p.error(error)
    tok = load_tokenizer(Path(path))
    if tok is None:  # random ids of the model's vocabulary, a seed a sample
        print("minference_search: the checkpoint has no tokenizer; using random token ids", file=sys.stderr)
        V = model.config.vocab_size
        samples = [torch.randint(min(100, V // 2), V, (args.length,), generator=torch.Generator().manual_seed(
            args.seed + j)).tolist() for j in range(args.samples)]
    else:
        samples = sample_prompts(tok, args.length, tasks, args.samples, args.seed)
    L = min(map(len, samples))  # the harness fits each sample to about --length: one length for all
    samples = [ids[:L] for ids in samples]
    if (error := window_error(model, L)) is not None:
        p.error(error)
    dflt = default_target(L)
    target = (args.target_sink or dflt[0], args.target_local or dflt[1])
    t0 = time.time()
    search = dict(layers=layers, progress=not args.quiet, block_size=args.block_size, last_q=args.last_q,
                  force_sink=args.force_sink, force_local=args.force_local, target=target,
                  recall_blocks=args.recall_blocks, vertical_aware=not args.minference_estimate,
                  target_recall=args.target_recall, kinds=kinds, recall_by=args.recall_by)
    if len(samples) == 1:
        found = run_search(model, samples[0], **search)
    else:
        found = run_search_samples(model, samples, **search)
    cfg = mi.MInferenceConfig(
        layers=found, block_size=args.block_size, last_q=args.last_q, force_sink=args.force_sink,
        force_local=args.force_local, vertical_aware=not args.minference_estimate,
        meta={"model": str(path), "sample": {"task": ",".join(tasks), "tokens": L, "seed": args.seed, "count": len(samples)},
              "target": {"sink": target[0], "local": target[1]}, "target_recall": args.target_recall,
              "kinds": list(kinds), "recall_by": args.recall_by, "rope_scaling": args.rope_scaling,
              "score": ("attention recall" + (" (its lowest sampled block)" if args.recall_by == "block" else "") +
                        (" at equal kernel cost" if args.target_recall is None else
                         f" of the cheapest pattern reaching {args.target_recall}")),
              "searched_layers": sorted(i for i, d in enumerate(found) if d), "seconds": round(time.time() - t0, 1)},
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cfg.save(out)
    if args.published:
        Path(args.published).write_text(json.dumps(cfg.to_published()) + "\n")
    kinds = [p.kind for layer in cfg.layers for p in layer.values()]
    scores = [p.score for layer in cfg.layers for p in layer.values() if p.score is not None]
    summary = {"out": str(out), "heads": len(kinds), **{k: kinds.count(k) for k in sorted(set(kinds))},
               "mean_recall": round(sum(scores) / max(1, len(scores)), 4), "sample_tokens": L,
               "target": list(target), "seconds": cfg.meta["seconds"]}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
