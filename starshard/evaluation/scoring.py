"""Task metrics, RULER's string match: an expected answer counts as found when it occurs in the
output, case-insensitively.

- "all": share of the expected answers found (partial credit; 1.0 only when every one is there)
- "any": 1.0 if at least one expected answer is found
"""
from __future__ import annotations

METRICS = ("all", "any")


def found(answers: list[str], output: str) -> list[bool]:
    """Which expected answers occur in the output."""
    out = output.lower()
    return [a.lower() in out for a in answers]


def score(answers: list[str], metric: str, output: str) -> float:
    if not answers or not all(answers):
        raise ValueError(f"a sample needs at least one non-empty expected answer, got {answers!r}")
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}: use one of {', '.join(METRICS)}")
    hits = found(answers, output)
    return sum(hits) / len(hits) if metric == "all" else float(any(hits))
