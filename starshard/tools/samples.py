"""The harness prompts the offline searches measure on (`starshard minference-search`, `starshard
anchor-calibrate`): the same tasks, seeds and depths for both, so a config searched by one and a
calibration made by the other see the same text."""
from __future__ import annotations

from starshard.evaluation.tasks import make_sample
from starshard.runtime.prompt import build_prompt


def sample_prompts(tok, length: int, tasks: list[str], n: int, seed: int) -> list[list[int]]:
    """Token ids of n harness prompts of about `length` tokens: the tasks in turn, seeds seed, seed + 1, ...,
    needle depths spread over (0, 1) (one prompt: half depth)."""
    out = []
    for i in range(n):
        s = make_sample(tasks[i % len(tasks)], tok, length, (i + 0.5) / n, seed + i)
        out.append(build_prompt(tok, context=s.context, question=s.question).ids[:length])
    return out
