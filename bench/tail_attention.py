#!/usr/bin/env python
"""Dense attention of a tail block (rows at key offset E over E + L keys: a chunk after its prefix,
an APB block after its anchor and passing keys): `attention.causal_attention_at` (a full part and a
square causal part, two fused calls merged by lse) against the dispatcher given the positions (one
masked call: the Triton flash kernel on CUDA). Random q / k / v (dense speed only).

    PYTHONPATH=. python bench/tail_attention.py --out tail.json
    PYTHONPATH=. python bench/tail_attention.py --heads 32 --kv-heads 8 --head-dim 128 --rows 32768 --extras 8192
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402

from starshard.benchmarks.common import DTYPES, commit, device_name, timed_median, utc_now  # noqa: E402
from starshard.kernels.attention import attention, causal_attention_at  # noqa: E402


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 1)[1])
    p.add_argument("--heads", type=int, default=9, help="query heads (default: SmolLM2's 9)")
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rows", default="32768,131072", help="comma-separated block rows L")
    p.add_argument("--extras", default="8192,32768", help="comma-separated keys before the block E")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=None, help="output JSON (also printed)")
    args = p.parse_args(argv)
    dev, dtype = torch.device(args.device), DTYPES[args.dtype]
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for L in (int(x) for x in args.rows.split(",")):
        for E in (int(x) for x in args.extras.split(",")):
            q = torch.randn(1, args.heads, L, args.head_dim, device=dev, dtype=dtype, generator=g)
            k = torch.randn(1, args.kv_heads, E + L, args.head_dim, device=dev, dtype=dtype, generator=g)
            v = torch.randn(1, args.kv_heads, E + L, args.head_dim, device=dev, dtype=dtype, generator=g)
            k_pos, q_pos = torch.arange(E + L, device=dev), torch.arange(E, E + L, device=dev)
            split = lambda: causal_attention_at(q, k, v, q_pos=q_pos, k_pos=k_pos, offset=E)  # noqa: E731
            masked = lambda: attention(q, k, v, q_pos=q_pos, k_pos=k_pos, causal=True)  # noqa: E731
            (o1, l1), (o2, l2) = split(), masked()
            flops = 4 * args.head_dim * args.heads * (L * E + L * (L + 1) // 2)
            t_split = timed_median(split, dev, args.repeats, args.warmup)
            t_masked = timed_median(masked, dev, args.repeats, args.warmup)
            row = {"rows": L, "extras": E, "split_ms": t_split * 1e3, "masked_ms": t_masked * 1e3,
                   "speedup": t_masked / t_split, "split_tflops": flops / t_split / 1e12,
                   "max_abs_out_diff": (o1.float() - o2.float()).abs().max().item(),
                   "max_abs_lse_diff": (l1 - l2).abs().max().item()}
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
            del q, k, v, o1, o2, l1, l2
    result = {"kind": "tail_attention", "date": utc_now(), "device": device_name(dev), "commit": commit(),
              "torch": torch.__version__, "shape": {"heads": args.heads, "kv_heads": args.kv_heads,
                                                    "head_dim": args.head_dim, "dtype": args.dtype},
              "inputs": "random normal q / k / v", "timing": f"median of {args.repeats} after {args.warmup}",
              "rows": rows}
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        print(text)
    return result


if __name__ == "__main__":
    main()
