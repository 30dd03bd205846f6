"""A model's AnchorAttention thresholds, per layer and query head, and their JSON file.

    cfg = AnchorModelConfig.load("anchor.json")          # written by starshard.tools.anchor_calibrate
    spec = cfg.pattern(layer, num_heads=Hq)               # an AnchorConfig with one theta per head
    out, lse = attention(q, k, v, q_pos=..., k_pos=..., sparse=spec)

theta keeps its meaning (`anchor.AnchorConfig`): a key is kept for a query block when the block's
mean of (anchor score - key score), in natural-log units of the softmax weight, is at most theta.
How far below the anchor the keys that matter lie depends on the model and the head, so one number
for every model (the paper's 12, for 8B models) is too loose for some heads and too tight for
others; a calibrated file holds, per head, the smallest theta whose kept attention mass reached a
recall target on sample prompts (the lowest density at that recall). The pooling (block_q, step),
the initial tokens and the window are one per file: the kernel runs them for all heads of a call.

File format (same layout as the MInference config, `minference.config`):
    {"format": "starshard.anchor/1", "block_q": 16, "block_k": 64, "init_tokens": 128, "local_window": 0,
     "step": 1, "default": {"theta": 12.0}, "meta": {...},
     "layers": [{"0": {"theta": 3.25, "score": 0.962, "density": 0.18}, ...}, ...]}
score and density are what the calibration measured for that head (recall, kept share of causal pairs);
heads and layers the file does not name use `default`. theta may be "inf" (the head keeps every key:
exact attention; with the fallback it runs the dense kernel).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from starshard.kernels.anchor import AnchorConfig

FORMAT = "starshard.anchor/1"


def _theta(v) -> float:
    """A theta read from JSON: a number or "inf" / "-inf"."""
    if isinstance(v, str) and v.strip().lower() in ("inf", "+inf", "infinity", "-inf", "-infinity"):
        return float(v)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
        raise ValueError(f"an AnchorAttention theta must be a number or \"inf\", got {v!r}")
    return float(v)


def _json_theta(t: float):
    return t if math.isfinite(t) else ("inf" if t > 0 else "-inf")


@dataclass
class AnchorModelConfig:
    """Per-layer, per-head thetas with the pooling shared by every head. `pattern(layer, num_heads,
    head_offset)` gives one call's AnchorConfig (a tensor- or Ulysses-parallel rank holds a slice of
    the heads)."""

    layers: list = field(default_factory=list)  # list[dict[int, float]]: theta per query head
    default: float = 12.0
    block_q: int = 128
    block_k: int = 64
    init_tokens: int = 128
    local_window: int = 0
    step: int = 16
    scores: list = field(default_factory=list)  # list[dict[int, dict]]: what the calibration measured
    meta: dict = field(default_factory=dict)

    FORMAT = FORMAT

    def __post_init__(self):
        self.layers = [{int(h): _theta(t) for h, t in layer.items()} for layer in self.layers]
        self.default = _theta(self.default)
        self.base(self.default)  # validates the pooling once, with a clear message

    def base(self, theta) -> AnchorConfig:
        return AnchorConfig(theta=theta, block_q=self.block_q, block_k=self.block_k, init_tokens=self.init_tokens,
                            local_window=self.local_window, step=self.step)

    def theta(self, layer: int, head: int) -> float:
        if 0 <= layer < len(self.layers):
            return self.layers[layer].get(head, self.default)
        return self.default

    def pattern(self, layer: int, num_heads: int, head_offset: int = 0) -> AnchorConfig:
        thetas = [self.theta(layer, head_offset + h) for h in range(num_heads)]
        return self.base(thetas[0] if len(set(thetas)) == 1 else tuple(thetas))

    # ---- JSON ----
    def to_dict(self) -> dict:
        def entry(layer, h, t):
            extra = self.scores[layer].get(h, {}) if layer < len(self.scores) else {}
            return {"theta": _json_theta(t), **extra}

        return {
            "format": FORMAT, "block_q": self.block_q, "block_k": self.block_k, "init_tokens": self.init_tokens,
            "local_window": self.local_window, "step": self.step, "default": {"theta": _json_theta(self.default)},
            "meta": self.meta,
            "layers": [{str(h): entry(i, h, t) for h, t in sorted(layer.items())} for i, layer in enumerate(self.layers)],
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def from_dict(cls, obj) -> AnchorModelConfig:
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            got = obj.get("format") if isinstance(obj, dict) else type(obj).__name__
            raise ValueError(f"not an AnchorAttention config: expected format {FORMAT!r}, got {got!r} (a MInference "
                             "config goes with --sparse minference; write one for anchor with "
                             "`python -m starshard.tools.anchor_calibrate --out FILE`)")
        layers = obj.get("layers", [])
        if not isinstance(layers, list) or not all(isinstance(x, dict) for x in layers):
            raise ValueError("an AnchorAttention config's layers are a list of {head: {\"theta\": T, ...}}")
        for layer in layers:
            for h, e in layer.items():
                if not isinstance(e, dict) or "theta" not in e:
                    raise ValueError(f"AnchorAttention config head {h}: expected {{\"theta\": T, ...}}, got {e!r}")
        default = obj.get("default", {"theta": 12.0})
        return cls(
            layers=[{h: e["theta"] for h, e in layer.items()} for layer in layers],
            default=default["theta"] if isinstance(default, dict) else default,
            block_q=int(obj.get("block_q", 128)), block_k=int(obj.get("block_k", 64)),
            init_tokens=int(obj.get("init_tokens", 128)), local_window=int(obj.get("local_window", 0)),
            step=int(obj.get("step", 16)),
            scores=[{int(h): x for h, e in layer.items() if (x := {k: v for k, v in e.items() if k != "theta"})}
                    for layer in layers],
            meta=obj.get("meta", {}),
        )

    @classmethod
    def load(cls, path: str | Path) -> AnchorModelConfig:
        with open(path) as f:
            obj = json.load(f)
        cfg = cls.from_dict(obj)
        cfg.meta = {**cfg.meta, "source": str(path)}
        return cfg


__all__ = ["FORMAT", "AnchorModelConfig"]
