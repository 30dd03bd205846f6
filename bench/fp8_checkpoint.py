"""FP8 checkpoints (issue 19 item 2): disk bytes and load time of a `convert --fp8 linear` checkpoint
against the bf16 one of the same model, and the loaded FP8 weights against --fp8 linear quantizing the
bf16 checkpoint at load time on this device (bit for bit: on CUDA the load-time path quantizes with
the Triton kernel, the converter on the CPU with torch ops).

    python bench/fp8_checkpoint.py --preset llama-3.1-8b --work /tmp/fp8ckpt --out fp8_checkpoint.json

A random-weight HF directory of the preset's shape (bf16, std 0.02) is written first (one safetensors
file per layer); both conversions read it. Load times are LLM(...) construction, each checkpoint
loaded twice in turn (the first read may come from disk, later ones from the page cache: both kept).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from starshard import LLM  # noqa: E402
from starshard.checkpoints.convert import convert  # noqa: E402
from starshard.checkpoints.sources import RandomSource  # noqa: E402
from starshard.presets import PRESETS, preset_config  # noqa: E402

LAYER = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
         "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
         "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]


def write_hf(out: Path, preset: str) -> Path:
    """A dense Llama-layout HF dir of the preset's shape with random bf16 weights."""
    cfg = preset_config(preset)
    src = RandomSource(cfg, 0, torch.bfloat16, "cpu")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({"model_type": "llama", **PRESETS[preset]}))  # a config transformers reads
    head = ["model.embed_tokens.weight", "model.norm.weight"] + ([] if cfg.tie_word_embeddings else ["lm_head.weight"])
    save_file({n: src.get(n) for n in head}, str(out / "model-head.safetensors"))
    for i in range(cfg.num_layers):
        names = [f"model.layers.{i}.{n}" for n in LAYER]
        save_file({n: src.get(n) for n in names}, str(out / f"model-layer{i:03d}.safetensors"))
    return out


def disk_bytes(ckpt: Path) -> int:
    return sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama-3.1-8b", help="dense Llama-layout preset (starshard/presets.py)")
    ap.add_argument("--work", type=Path, required=True, help="scratch dir for the HF dir and both checkpoints")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=None, help="JSON results file")
    args = ap.parse_args(argv)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    hf = args.work / "hf"
    t = time.perf_counter()
    if not (hf / "config.json").is_file():
        write_hf(hf, args.preset)
    row = {"preset": args.preset, "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
           "torch": torch.__version__, "write_hf_seconds": time.perf_counter() - t}
    ckpts = {}
    for name, fp8 in (("bf16", None), ("fp8", "linear")):
        t = time.perf_counter()
        ckpts[name] = convert(out=args.work / name, hf_dir=hf, dtype="bfloat16", fp8=fp8, progress=False)
        row[f"convert_seconds_{name}"] = time.perf_counter() - t
        row[f"disk_bytes_{name}"] = disk_bytes(ckpts[name])
    row["disk_ratio"] = row["disk_bytes_fp8"] / row["disk_bytes_bf16"]
    for i in range(2):
        for name in ("bf16", "fp8"):
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            t = time.perf_counter()
            llm = LLM(ckpts[name], device=args.device, dtype=dtype, fp8="linear", progress=False)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            row.setdefault(f"load_seconds_{name}", []).append(time.perf_counter() - t)
            if i == 1:
                row[f"weight_bytes_{name}"] = sum(v.numel() * v.element_size() for v in llm.model.state_dict().values()
                                                  if isinstance(v, torch.Tensor))
                if name == "bf16":
                    quantized = {k: v.cpu() for k, v in llm.model.state_dict().items() if isinstance(v, torch.Tensor)}
                else:
                    stored = {k: v.cpu() for k, v in llm.model.state_dict().items() if isinstance(v, torch.Tensor)}
            del llm

    def bits(t):
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t

    row["bit_identical_to_load_time_quantization"] = sorted(quantized) == sorted(stored) and all(
        torch.equal(bits(quantized[k]), bits(stored[k])) for k in quantized)
    row["tensors_differing"] = [k for k in quantized if k in stored and not torch.equal(bits(quantized[k]), bits(stored[k]))][:8]
    print(json.dumps(row, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
