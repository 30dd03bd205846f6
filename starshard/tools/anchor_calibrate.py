"""Offline per-head calibration of AnchorAttention's threshold -> per-layer, per-head JSON config.

    python -m starshard.tools.anchor_calibrate --model M --out anchor.json [--length 8192] [--target-recall 0.99]
    python launch/infer.py --sparse anchor --sparse-config anchor.json ...   # any entry point with --sparse

AnchorAttention keeps key j for a query block when the block's mean gap between its rows' anchor
scores and their scores of j is at most theta (natural-log units of the softmax weight). What share
of the attention mass a given theta keeps depends on the model and the head, so this tool picks
theta per head: harness prompts (starshard.evaluation.tasks, sized in the model's tokens) run
through the model once each; at every layer the post-RoPE q, k are intercepted (the layer's
`attend` is wrapped, then put back) and, per query head, for every theta of a grid it measures
- recall: the share of the dense causal softmax mass of `--recall-rows` rows (spread over the last
  three quarters of the prompt) that the anchor region plus the stripes selected at that theta keep
  (the metric of the paper and of the MInference search), and
- density: the share of the causal (row, key) pairs the sparse step computes (`anchor.head_density`).
Each key's gap is computed once (the kernels' identification quantities: `anchor_scores`,
`pool_blocks`), so the whole grid costs one pass. Per head the file keeps the smallest theta whose
recall, averaged over the prompts, reaches `--target-recall`: the lowest density at that recall
(density grows with theta). A head that reaches it only by keeping every key gets theta "inf" (exact;
the fallback then runs the dense kernel for it). The pooling (`--block-q`, `--step`), initial tokens
and window are the file's, shared by all heads (the kernel runs them per call).

Thetas are found at the sample length and applied unchanged at others, like the MInference search's
budgets: at longer prompts more candidates lie within a given gap, so density and recall both rise.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

import starshard
from starshard.checkpoints.named import resolve_model
from starshard.cli import add_rope_scaling_argument, parse_layer_ids
from starshard.evaluation.tasks import parse_tasks
from starshard.kernels.anchor import (
    AnchorConfig,
    StripeIndex,
    anchor_region,
    anchor_scores,
    head_density,
    pool_blocks,
)
from starshard.kernels.anchor_model import AnchorModelConfig
from starshard.runtime.prompt import load_tokenizer
from starshard.tools.layer_probe import layers_error, probe_layers, window_error
from starshard.tools.samples import sample_prompts

_CHUNK = 1 << 26  # elements of one float32 gap / score tile


def theta_grid(lo: float = -4.0, hi: float = 40.0, step: float = 0.25) -> torch.Tensor:
    """Ascending candidate thetas: -inf (no stripes), lo .. hi by step, +inf (every candidate)."""
    n = round((hi - lo) / step) + 1
    finite = torch.linspace(lo, lo + (n - 1) * step, n, dtype=torch.float64)
    return torch.cat([torch.tensor([-math.inf], dtype=torch.float64), finite, torch.tensor([math.inf], dtype=torch.float64)])


def sample_rows(Lq: int, n: int, device=None) -> torch.Tensor:
    """Up to n query rows spread evenly over the last three quarters."""
    return torch.linspace(Lq // 4, Lq - 1, max(1, min(n, Lq - Lq // 4))).round().long().unique().to(device)


def _group_gaps(qbar, xbar, k, cfg: AnchorConfig, groups: range, ws: torch.Tensor, scale: float) -> torch.Tensor:
    """[Hq, len(groups), Lk]: per group, the smallest block gap xbar_m - qbar_m . k_j * scale over its
    blocks, +inf where j is not a candidate of the group (j < init_tokens or j >= ws_g)."""
    Hq, nM, D = qbar.shape
    Hkv, Lk = k.shape[0], k.shape[1]
    m0, m1 = groups.start * cfg.step, min(nM, groups.stop * cfg.step)
    qb = qbar[:, m0:m1].reshape(Hkv, Hq // Hkv, m1 - m0, D)
    s = torch.einsum("hgmd,hkd->hgmk", qb, k).reshape(Hq, m1 - m0, Lk) * scale
    gap = xbar[:, m0:m1, None] - s
    pad = len(groups) * cfg.step - (m1 - m0)
    gap = torch.nn.functional.pad(gap, (0, 0, 0, pad), value=math.inf).view(Hq, len(groups), cfg.step, Lk).amin(2)
    j = torch.arange(Lk, device=k.device)
    cand = (j[None, :] >= cfg.init_tokens) & (j[None, :] < ws[groups.start:groups.stop, None])
    return gap.masked_fill(~cand[None], math.inf)


def layer_curves(q, k, cfg: AnchorConfig, grid: torch.Tensor, *, recall_rows: int = 256, scale=None):
    """Recall and density per query head at every theta of `grid` for one layer's prefill (batch row
    0; q [B, Hq, L, D] after RoPE, k [B, Hkv, L', D], the queries the last L keys) -> (recall [Hq, T],
    density [Hq, T]) float64 on the CPU."""
    q, k = q[:1], k[:1]
    Hq, Lq, D = q.shape[1], q.shape[2], q.shape[3]
    Hkv, Lk = k.shape[1], k.shape[2]
    off = Lk - Lq
    scale = D**-0.5 if scale is None else scale
    T = grid.numel()
    dev = q.device
    grid_d = grid.to(dev)
    xa = anchor_scores(q, k, cfg, offset=off, scale=scale)
    qbar, xbar = pool_blocks(q, xa, cfg.block_q)
    qbar, xbar = qbar[0], xbar[0]
    acc = qbar.dtype
    kf = k[0].to(acc)
    nM = qbar.shape[1]
    G = -(-nM // cfg.step)
    rpg = cfg.block_q * cfg.step
    ws = torch.arange(G, device=dev) * rpg + off - cfg.local_window
    ws = ws.clamp(min=0)

    # dense softmax of the sampled rows, their region mass, and which group each belongs to
    rows = sample_rows(Lq, recall_rows, dev)
    kk = kf.repeat_interleave(Hq // Hkv, 0)
    probs = torch.empty(Hq, rows.numel(), Lk, dtype=acc, device=dev)
    step_r = max(1, _CHUNK // max(1, Hq * Lk))
    for r0 in range(0, rows.numel(), step_r):
        r = rows[r0:r0 + step_r]
        s = torch.einsum("hrd,hkd->hrk", q[0, :, r].to(acc), kk) * scale
        vis = torch.arange(Lk, device=dev)[None, :] <= (r + off)[:, None]
        probs[:, r0:r0 + step_r] = torch.softmax(s.masked_fill(~vis, -math.inf), -1)
    region = anchor_region(cfg, Lq=Lq, Lk=Lk, offset=off, rows=rows)
    region_mass = (probs * region).sum(-1).double().mean(-1)  # [Hq]
    row_group = rows // rpg

    rec_bins = torch.zeros(Hq, T + 1, dtype=torch.float64, device=dev)
    den_bins = torch.zeros(Hq, T + 1, dtype=torch.float64, device=dev)
    rows_per_group = (torch.clamp(torch.arange(1, G + 1, device=dev) * rpg, max=Lq) - torch.arange(G, device=dev) * rpg)
    per = max(1, _CHUNK // max(1, Hq * Lk * cfg.step))
    for g0 in range(0, G, per):
        groups = range(g0, min(G, g0 + per))
        gap = _group_gaps(qbar, xbar, kf, cfg, groups, ws, scale)  # [Hq, gc, Lk]
        # bin i: the first theta of the grid with gap <= theta; a key kept at theta_i iff its bin <= i
        bins = torch.searchsorted(grid_d, gap.double().contiguous(), side="left")
        bins = torch.where(torch.isinf(gap) & (gap > 0), T, bins)  # non-candidates: the spare bin
        w = rows_per_group[g0:g0 + len(groups)].double()[None, :, None].expand_as(bins)
        den_bins.scatter_add_(1, bins.reshape(Hq, -1), w.reshape(Hq, -1))
        mine = (row_group >= groups.start) & (row_group < groups.stop)
        if mine.any():
            sel = mine.nonzero().squeeze(1)
            rb = bins[:, row_group[sel] - groups.start]  # [Hq, r, Lk]
            rec_bins.scatter_add_(1, rb.reshape(Hq, -1), probs[:, sel].double().reshape(Hq, -1))
    recall = region_mass[:, None] + rec_bins[:, :T].cumsum(1) / rows.numel()
    causal = (torch.arange(Lq, device=dev) + off + 1).clamp(max=Lk).double().sum()
    empty = StripeIndex(torch.zeros(1, Hq, G, 0, dtype=torch.int32, device=dev), torch.zeros(1, Hq, G, dtype=torch.int32, device=dev))
    region_share = head_density(empty, cfg, Lq=Lq, Lk=Lk, offset=off)[0]
    density = region_share[:, None] + den_bins[:, :T].cumsum(1) / causal
    return recall.cpu(), density.cpu()


def run_curves(model, ids, cfg: AnchorConfig, grid, *, layers=None, recall_rows=256, progress=True) -> list:
    """One forward pass over `ids`; per selected layer its (recall, density) curves (None elsewhere)."""
    found: list = [None for _ in model.layers]

    def observe(i, q, k):
        t = time.time()
        found[i] = layer_curves(q, k, cfg, grid, recall_rows=recall_rows)
        if progress:
            print(f"layer {i}: {time.time() - t:.1f}s", file=sys.stderr)

    probe_layers(model, ids, observe, layers)
    return found


def choose(recall: torch.Tensor, density: torch.Tensor, grid: torch.Tensor, target: float):
    """Per head: the smallest theta of the grid whose recall reaches `target` -> [(theta, recall, density)].
    The last grid entry (+inf: every candidate, recall 1 up to rounding) is the fallback."""
    out = []
    for h in range(recall.shape[0]):
        ok = (recall[h] >= target).nonzero()
        i = int(ok[0]) if ok.numel() else grid.numel() - 1
        out.append((float(grid[i]), float(recall[h, i]), float(density[h, i])))
    return out


def calibrate(model, samples: list, cfg: AnchorConfig, *, target: float, grid=None, layers=None, recall_rows=256,
              progress=True, meta=None) -> AnchorModelConfig:
    """Curves averaged over the sample prompts (lists of token ids), thetas chosen per head."""
    grid = theta_grid() if grid is None else grid
    sums: list = [None for _ in model.layers]
    for ids in samples:
        for i, cur in enumerate(run_curves(model, ids, cfg, grid, layers=layers, recall_rows=recall_rows,
                                           progress=progress)):
            if cur is not None:
                sums[i] = cur if sums[i] is None else (sums[i][0] + cur[0], sums[i][1] + cur[1])
    found, scores = [], []
    for s in sums:
        if s is None:
            found.append({})
            scores.append({})
            continue
        picks = choose(s[0] / len(samples), s[1] / len(samples), grid, target)
        found.append({h: t for h, (t, _, _) in enumerate(picks)})
        scores.append({h: {"score": round(r, 6), "density": round(d, 6)} for h, (_, r, d) in enumerate(picks)})
    return AnchorModelConfig(layers=found, default=cfg.theta, block_q=cfg.block_q, block_k=cfg.block_k,
                             init_tokens=cfg.init_tokens, local_window=cfg.local_window, step=cfg.step, scores=scores,
                             meta=meta or {})


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="starshard anchor-calibrate", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="checkpoint dir, HF dir or .gguf (default: the embedded default model)")
    p.add_argument("--out", required=True, help="output JSON (starshard AnchorAttention config, for --sparse-config)")
    p.add_argument("--length", type=int, default=8192, help="sample prompt length in tokens (default 8192)")
    p.add_argument("--tasks", default="multikey,niah_essay,multiquery",
                   help="harness tasks of the sample prompts, comma-separated, used in turn (starshard.evaluation.tasks; "
                   "as minference-search's --tasks)")
    p.add_argument("--samples", type=int, default=3, help="sample prompts; recall and density are averaged over them")
    p.add_argument("--seed", type=int, default=0, help="seed of the first sample prompt; the others follow (default 0)")
    p.add_argument("--target-recall", type=float, default=0.99,
                   help="per head, the attention mass the kept keys must hold, averaged over the measured rows "
                   "(default 0.99, as minference_search's: on SmolLM2 files at 0.95 / 0.98 / 0.99 kept 0.92 / "
                   "0.94 / 0.96 of dense's harness score); the smallest theta reaching it is kept")
    p.add_argument("--block-q", type=int, default=128, help="query rows pooled per block (the kernel's; default 128)")
    p.add_argument("--step", type=int, default=16, help="query blocks sharing one stripe selection (default 16)")
    p.add_argument("--block-k", type=int, default=64, help="keys per load in the kernels (default 64)")
    p.add_argument("--init-tokens", type=int, default=128, help="initial keys always attended (default 128)")
    p.add_argument("--local-window", type=int, default=0, help="keys before a group's first row in its window (default 0)")
    p.add_argument("--default-theta", type=float, default=12.0, help="theta of heads and layers not calibrated")
    p.add_argument("--theta-range", default="-4,40,0.25", metavar="LO,HI,STEP",
                   help="the finite thetas tried (default -4,40,0.25; -inf and inf are always tried)")
    p.add_argument("--recall-rows", type=int, default=256, help="query rows the recall is measured on, per prompt")
    p.add_argument("--layers", default=None, metavar="I,J,A-B",
                   help="layer ids or ranges to calibrate, e.g. 0,5,10-14 (others: --default-theta; the forward stops after the last)")
    add_rope_scaling_argument(p)  # a config for YaRN runs past the window is searched with YaRN
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the model runs (default: cuda where there is one, else cpu)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="the model's dtype (default bfloat16, as it runs; the measurement is float32)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr (the summary line still prints)")
    args = p.parse_args(argv)
    if not 0.0 < args.target_recall <= 1.0:
        p.error(f"--target-recall must be in (0, 1], got {args.target_recall}")
    try:
        lo, hi, st = (float(x) for x in args.theta_range.split(","))
        if not (st > 0 and hi >= lo):
            raise ValueError
    except ValueError:
        p.error(f"--theta-range is LO,HI,STEP with HI >= LO and STEP > 0, got {args.theta_range!r}")
    try:
        cfg = AnchorConfig(theta=args.default_theta, block_q=args.block_q, block_k=args.block_k,
                           init_tokens=args.init_tokens, local_window=args.local_window, step=args.step)
    except ValueError as e:
        p.error(str(e))
    layers = parse_layer_ids(args.layers)  # a malformed list is refused before the model loads
    try:
        tasks = parse_tasks(args.tasks)
    except ValueError as e:
        p.error(str(e))
    if args.samples < 1:
        p.error(f"--samples must be at least 1, got {args.samples}")

    path = resolve_model(args.model, progress=not args.quiet)[0]  # a GGUF or a model by name: converted once
    tok = load_tokenizer(path)
    if tok is None:
        p.error(f"{path} has no tokenizer: the calibration runs the model on harness prompts (text)")
    model = starshard.load_model(path, dtype=getattr(torch, args.dtype), device=args.device,
                                rope_scaling=args.rope_scaling)
    if (error := layers_error(layers, len(model.layers))) is not None:
        p.error(error)
    samples = sample_prompts(tok, args.length, tasks, args.samples, args.seed)
    if (error := window_error(model, max(map(len, samples)))) is not None:
        p.error(error)
    t0 = time.time()
    meta = {"model": str(path), "target_recall": args.target_recall, "dtype": args.dtype,
            "rope_scaling": args.rope_scaling,
            "samples": {"tasks": tasks, "count": len(samples), "tokens": [len(s) for s in samples], "seed": args.seed},
            "score": "attention recall (mean over rows and prompts) at the chosen theta", "theta_range": [lo, hi, st]}
    out_cfg = calibrate(model, samples, cfg, target=args.target_recall, grid=theta_grid(lo, hi, st), layers=layers,
                        recall_rows=args.recall_rows, progress=not args.quiet, meta=meta)
    out_cfg.meta["seconds"] = round(time.time() - t0, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out_cfg.save(out)
    picked = [(t, s) for layer, sc in zip(out_cfg.layers, out_cfg.scores) for h, t in layer.items() for s in [sc[h]]]
    finite = [t for t, _ in picked if math.isfinite(t)]
    summary = {"out": str(out), "heads": len(picked), "heads_inf": sum(t == math.inf for t, _ in picked),
               "heads_no_stripes": sum(t == -math.inf for t, _ in picked),
               "theta_median": sorted(finite)[len(finite) // 2] if finite else None,
               "mean_recall": round(sum(s["score"] for _, s in picked) / max(1, len(picked)), 4),
               "mean_density": round(sum(s["density"] for _, s in picked) / max(1, len(picked)), 4),
               "sample_tokens": [len(s) for s in samples], "seconds": out_cfg.meta["seconds"]}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
