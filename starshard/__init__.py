"""starshard: tensor x pipeline x context parallel inference for long-context LLMs."""
from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["LLM", "Output", "load_model", "__version__"]


def __getattr__(name):
    # Lazy: `import starshard` stays cheap (no transformers import) for launchers and workers.
    if name in ("LLM", "Output"):
        from starshard.engine import generate

        return getattr(generate, name)
    if name == "load_model":
        from starshard.checkpoints.load import load_model

        return load_model
    raise AttributeError(f"module 'starshard' has no attribute {name!r}")
