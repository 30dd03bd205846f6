"""Convert a Hugging Face model dir (safetensors) or a GGUF file into starshard per-(tp, pp) shards.

    python -m starshard.checkpoints.convert --hf DIR --out OUT [--tp N] [--pp N] [--dtype bfloat16]
    python -m starshard.checkpoints.convert --gguf FILE --out OUT

Output: OUT/manifest.json (model config, layout, dtype, source, per-tensor sha256), one
`model-tp{t}-pp{p}.safetensors` per rank of the layout, and the tokenizer files. Safetensors sources
are streamed tensor by tensor, so peak memory is about one (fused) tensor, not the model. GGUF goes
through transformers' GGUF reader, which dequantizes the whole model in memory first.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import struct
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from starshard.checkpoints.hf import (
    SafetensorsSource,
    StateDictSource,
    TensorSource,
    plan_shard,
    read_hf_config,
)
from starshard.config import ModelConfig, UnsupportedArchitectureError
from starshard.layout import TPLayout, partition_layers

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_ST_DTYPE = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def shard_file(tp_rank: int, pp_rank: int) -> str:
    return f"model-tp{tp_rank}-pp{pp_rank}.safetensors"


def tensor_bytes(t: torch.Tensor) -> bytes:
    # Raw little-endian bytes of any dtype (numpy has no bfloat16, so view as uint8).
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


def write_safetensors_streaming(path: Path, specs, dtype: torch.dtype, metadata: dict[str, str]) -> dict[str, str]:
    """Write tensors one at a time in safetensors format (header first, computed from the specs).

    Returns {name: sha256 of the tensor's bytes}. Each built tensor is checked against its spec shape.
    """
    itemsize = torch.empty(0, dtype=dtype).element_size()
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for s in specs:
        n = itemsize
        for dim in s.shape:
            n *= dim
        header[s.name] = {"dtype": _ST_DTYPE[dtype], "shape": list(s.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data section starts 8-byte aligned
    sums = {}
    tmp = path.with_suffix(path.suffix + ".partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for s in specs:
            t = s.build().to(dtype)
            if tuple(t.shape) != s.shape:
                raise ValueError(f"{s.name}: source gives shape {tuple(t.shape)}, expected {s.shape}")
            data = tensor_bytes(t)
            sums[s.name] = hashlib.sha256(data).hexdigest()
            f.write(data)
    tmp.replace(path)
    return sums


def gguf_to_hf(gguf_path: Path):
    """Dequantize a GGUF through transformers: (hf config dict, state dict, tokenizer)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    kw = dict(gguf_file=gguf_path.name)
    hf_cfg = AutoConfig.from_pretrained(gguf_path.parent, **kw).to_dict()
    if ModelConfig.from_hf(hf_cfg).num_experts:  # refuse unsupported models before the slow load
        raise UnsupportedArchitectureError(
            f"{gguf_path.name}: GGUF files of mixture-of-experts models ({hf_cfg.get('model_type')}) are not supported; "
            "convert the model's Hugging Face safetensors directory instead (--hf DIR)")
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, torch_dtype=torch.float32, **kw)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
    hf_cfg.pop("quantization_config", None)
    return hf_cfg, model.state_dict(), tok


def convert(
    *,
    out: Path,
    hf_dir: Path | None = None,
    gguf: Path | None = None,
    tp: int = 1,
    pp: int = 1,
    pp_layers: list[int] | None = None,
    dtype: str = "bfloat16",
    progress: bool = True,
) -> Path:
    if (hf_dir is None) == (gguf is None):
        raise ValueError("give exactly one source: hf_dir or gguf")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    out = Path(out)
    if hf_dir is not None:
        hf_dir = Path(hf_dir)
        if not hf_dir.is_dir():
            raise FileNotFoundError(f"Hugging Face model directory not found: {hf_dir}")
        hf_cfg = read_hf_config(hf_dir)
        cfg = ModelConfig.from_hf(hf_cfg)
        src: TensorSource = SafetensorsSource(hf_dir)
        source = {"kind": "hf", "path": str(hf_dir.resolve())}
        tokenizer = None
        tok_dir = hf_dir
    else:
        hf_cfg, sd, tokenizer = gguf_to_hf(Path(gguf))
        cfg = ModelConfig.from_hf(hf_cfg)
        src = StateDictSource(sd)
        source = {"kind": "gguf", "path": str(Path(gguf).resolve())}
        tok_dir = None
    stages = partition_layers(cfg.num_layers, pp, pp_layers)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)  # a half-written dir must never look complete
    shards = {}
    total = sum(len(plan_shard(cfg, src, TPLayout(cfg, tp, 0), s, p == 0, p == pp - 1)) for p, s in enumerate(stages))
    bar = tqdm(total=total * tp, desc="convert", unit="tensor", disable=not progress)
    for p, layers in enumerate(stages):
        for t in range(tp):
            specs = plan_shard(cfg, src, TPLayout(cfg, tp, t), layers, p == 0, p == pp - 1)
            specs = [_ticking(s, bar) for s in specs]
            fname = shard_file(t, p)
            sums = write_safetensors_streaming(out / fname, specs, DTYPES[dtype], {"format": "pt"})
            shards[f"tp{t}-pp{p}"] = {"file": fname, "tensors": sums}
    bar.close()
    _save_tokenizer(out, tok_dir, tokenizer)
    manifest = {
        "format": "starshard",
        "version": FORMAT_VERSION,
        "model_config": cfg.to_dict(),
        "hf_config": hf_cfg,
        "tp": tp,
        "pp": pp,
        "pp_layers": [len(s) for s in stages],
        "dtype": dtype,
        "source": source,
        "shards": shards,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return out


def _ticking(spec, bar):
    build = spec.build

    def wrapped():
        t = build()
        bar.update(1)
        return t

    spec.build = wrapped
    return spec


def _save_tokenizer(out: Path, tok_dir: Path | None, tokenizer) -> None:
    if tokenizer is None:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(tok_dir)
        except (OSError, ValueError) as e:
            print(f"warning: no tokenizer saved ({e}); pass token ids, not text, to this checkpoint", file=sys.stderr)
            return
    tokenizer.save_pretrained(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m starshard.checkpoints.convert",
        description="Convert a Hugging Face model directory or a GGUF file into starshard shards, "
        "one safetensors file per (tensor-parallel rank, pipeline stage).",
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf", type=Path, metavar="DIR", help="Hugging Face model directory (config.json + *.safetensors)")
    src.add_argument("--gguf", type=Path, metavar="FILE", help="GGUF file (dequantized through transformers)")
    ap.add_argument("--out", type=Path, required=True, metavar="DIR", help="output directory")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size the shards are cut for (default 1)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel stages (default 1)")
    ap.add_argument(
        "--pp-layers",
        type=lambda s: [int(x) for x in s.split(",")],
        default=None,
        metavar="N,N,..",
        help="layers per pipeline stage, comma separated (default: even split)",
    )
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="stored dtype (default bfloat16)")
    args = ap.parse_args(argv)
    path = convert(
        out=args.out, hf_dir=args.hf, gguf=args.gguf, tp=args.tp, pp=args.pp, pp_layers=args.pp_layers, dtype=args.dtype
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
