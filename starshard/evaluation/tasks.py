"""RULER-style synthetic long-context tasks, generated locally from a seed (no downloads).

Every sample is a long `context` (filler with needles at a stated depth) and a short `question`
(the query part, which Star/APB treat as such), with the expected `answers`. Lengths are counted in
the model's tokens: the filler is sized so that context + question hit the target.
"""
from __future__ import annotations

import random
import string
from dataclasses import asdict, dataclass, field

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
_SUBJECTS = ["the river", "a small town", "the old library", "every winter", "the committee", "a quiet garden",
             "the market", "our neighbour", "the long road", "a careful reader", "the harbour", "the museum"]
_VERBS = ["changed", "remembered", "described", "carried", "opened", "followed", "measured", "welcomed",
          "questioned", "painted", "repaired", "forgot"]
_OBJECTS = ["the evening light", "a forgotten letter", "the first snow", "an honest answer", "the morning train",
            "a wooden bridge", "the village map", "a patient teacher", "the northern hills", "a simple plan"]
_TAILS = ["before anyone noticed.", "and nobody complained.", "as the seasons turned.", "with great care.",
          "for the third time that year.", "while the bells rang.", "in a way few expected."]
_WORDS = ["apple", "bridge", "candle", "desert", "engine", "forest", "garden", "harbor", "island", "jacket",
          "kettle", "ladder", "marble", "needle", "orange", "pillow", "quartz", "ribbon", "saddle", "tunnel",
          "umbrella", "velvet", "window", "yogurt", "zephyr", "anchor", "basket", "cactus", "dragon", "falcon"]
TASKS = ("passkey", "niah_number", "niah_uuid", "niah_word", "niah_essay", "multikey", "multivalue",
         "multiquery", "variable_tracking", "common_words")


@dataclass
class Sample:
    task: str
    length: int  # target prompt tokens (context + question)
    depth: float  # where the needle sits in the context, 0..1
    seed: int
    context: str
    question: str
    answers: list[str]
    metric: str  # "all": share of answers found; "any": 1 if one is found
    answer_prefix: str = ""  # completion cue (raw prompts end with it)
    needle_spans: list[tuple[int, int]] = field(default_factory=list)  # char spans in context

    def to_dict(self) -> dict:
        return asdict(self)


def _essay_sentence(rng: random.Random) -> str:
    return f"{rng.choice(_SUBJECTS).capitalize()} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)} "


def _uuid(rng: random.Random) -> str:
    h = "".join(rng.choice("0123456789abcdef") for _ in range(32))
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _key(rng: random.Random) -> str:
    return "-".join(rng.choice(_WORDS) for _ in range(2))


def _count(tok, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False))


def _assemble(tok, target: int, question: str, needles: list[str], depths: list[float], filler, rng) -> tuple[str, list]:
    """Context of filler units with needles inserted at their depths, sized to `target` tokens."""
    fixed = _count(tok, question) + sum(_count(tok, n) for n in needles) + 8
    units = [filler(rng) for _ in range(32)]
    for _ in range(6):  # resize from the measured tokens per unit until within one unit of target
        total = _count(tok, "".join(units))
        per_unit = max(1.0, total / len(units))
        gap = target - fixed - total
        if -per_unit < gap <= per_unit:
            break
        if gap > 0:
            units += [filler(rng) for _ in range(int(gap / per_unit))]
        else:
            del units[-min(len(units) - 1, int(-gap / per_unit) + 1):]
    n_units = len(units)
    # Insert deepest-first so earlier indices stay valid.
    order = sorted(range(len(needles)), key=lambda i: -depths[i])
    for i in order:
        units.insert(round(depths[i] * n_units), needles[i])
    context = "".join(units)
    spans = [(context.index(n), context.index(n) + len(n)) for n in needles]
    return context, spans


def make_sample(task: str, tok, length: int, depth: float, seed: int) -> Sample:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    rng = random.Random(f"{task}-{length}-{depth}-{seed}")
    noise = lambda r: NOISE  # noqa: E731
    essay = _essay_sentence
    metric, prefix = "all", ""
    if task == "passkey":
        key = str(rng.randint(10000, 99999))
        needles = [f"The pass key is {key}. Remember it. {key} is the pass key. "]
        question = "What is the pass key?"
        answers, prefix, filler = [key], "The pass key is", noise
    elif task.startswith("niah_"):
        kind = task.split("_")[1]
        key = _key(rng)
        value = {"number": str(rng.randint(1000000, 9999999)), "uuid": _uuid(rng), "word": rng.choice(_WORDS) + rng.choice(_WORDS),
                 "essay": str(rng.randint(1000000, 9999999))}[kind]
        noun = {"number": "number", "uuid": "uuid", "word": "word", "essay": "number"}[kind]
        needles = [f"One of the special magic {noun}s for {key} is: {value}. "]
        question = f"What is the special magic {noun} for {key} mentioned in the provided text?"
        answers, prefix = [value], f"The special magic {noun} for {key} mentioned in the provided text is"
        filler = essay if kind == "essay" else noise
    elif task == "multikey":
        keys = [_key(rng) for _ in range(4)]
        values = [str(rng.randint(1000000, 9999999)) for _ in keys]
        needles = [f"One of the special magic numbers for {k} is: {v}. " for k, v in zip(keys, values)]
        question = f"What is the special magic number for {keys[0]} mentioned in the provided text?"
        answers, prefix, filler = [values[0]], f"The special magic number for {keys[0]} mentioned in the provided text is", essay
    elif task == "multivalue":
        key = _key(rng)
        values = [str(rng.randint(1000000, 9999999)) for _ in range(4)]
        needles = [f"One of the special magic numbers for {key} is: {v}. " for v in values]
        question = f"What are all the special magic numbers for {key} mentioned in the provided text?"
        answers, prefix, filler = values, f"The special magic numbers for {key} mentioned in the provided text are", essay
    elif task == "multiquery":
        keys = [_key(rng) for _ in range(4)]
        values = [str(rng.randint(1000000, 9999999)) for _ in keys]
        needles = [f"One of the special magic numbers for {k} is: {v}. " for k, v in zip(keys, values)]
        question = f"What are the special magic numbers for {keys[0]} and {keys[1]} mentioned in the provided text?"
        answers, prefix, filler = values[:2], f"The special magic numbers for {keys[0]} and {keys[1]} are", essay
    elif task == "variable_tracking":
        value = str(rng.randint(10000, 99999))
        names = ["".join(rng.choice(string.ascii_uppercase) for _ in range(5)) for _ in range(4)]
        needles = [f"VAR {names[0]} = {value}. "] + [f"VAR {names[i]} = VAR {names[i - 1]}. " for i in range(1, 4)]
        question = f"Find all variables that are assigned the value {value} in the text above."
        answers, prefix, filler = names, f"The variables assigned the value {value} are:", noise
    else:  # common_words: a few words repeated often among many rare ones
        common = rng.sample(_WORDS, 5)
        rare = [w for w in _WORDS if w not in common]
        filler = lambda r: " ".join([r.choice(common)] * 3 + [r.choice(rare)]) + ". "  # noqa: E731
        needles = []
        question = "What are the 5 most common words in the text above?"
        answers, prefix = common, "The 5 most common words are:"
    depths = [depth] if len(needles) <= 1 else [min(1.0, depth + 0.1 * i) if depth < 0.6 else max(0.0, depth - 0.1 * i) for i in range(len(needles))]
    if task == "variable_tracking":  # the chain must be read in order
        depths = sorted(depths)
    context, spans = _assemble(tok, length, question, needles, depths, filler, rng)
    return Sample(task, length, depth, seed, context, question, answers, metric, prefix, spans)


def make_samples(tasks, tok, lengths, depths, per_cell: int, seed: int) -> list[Sample]:
    return [make_sample(t, tok, L, d, seed * 1000 + i) for t in tasks for L in lengths for d in depths for i in range(per_cell)]
