"""The distractor task (multikey: 4 needles, one asked), the prompt sizing's search against a brute
force, threaded sample making, and the paired comparison (`--compare`: of the samples dense answers
right, the share a strategy answers right too) on hand-made run directories. No model: word and
character tokenizers."""
import hashlib
import importlib.util
import json
import random
import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from starshard.evaluation import report, tasks
from starshard.evaluation.scoring import score
from starshard.evaluation.tasks import count_tokens, make_sample, make_samples

ROOT = Path(__file__).resolve().parents[2]


class Words:
    def encode(self, text, add_special_tokens=False):
        return text.split()


class Chars:
    """A tokenizer whose tokens per filler unit vary a lot (one per character, three per digit)."""

    def encode(self, text, add_special_tokens=False):
        return [c for ch in text for c in ((ch,) * 3 if ch.isdigit() else (ch,))]


class Marked:
    """One token more at the start of every text (as a SentencePiece tokenizer that prepends "▁"): a text's
    count is not the sum of its words' counts, so contexts are encoded whole."""

    def encode(self, text, add_special_tokens=False):
        return ["<start>"] + text.split()


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_multikey_has_four_needles_and_asks_one(depth):
    s = make_sample("multikey", Words(), 2000, depth, seed=11)
    needles = [s.context[a:b] for a, b in s.needle_spans]
    assert len(needles) == 4
    pairs = [re.fullmatch(r"The secret number assigned to (\S+) is (\d{7})\.", n).groups() for n in needles]
    keys, values = [k for k, _ in pairs], [v for _, v in pairs]
    assert len(set(keys)) == 4 and len(set(values)) == 4  # three distractors, each its own key and number
    assert s.question == f"What is the secret number assigned to {keys[0]}?"
    assert s.answers == [values[0]] and s.answer_prefix.endswith(f"{keys[0]} is")
    for k, v in pairs:  # every needle once in the context, the asked one among them
        assert s.context.count(f"assigned to {k} is {v}.") == 1
    # The asked needle starts at the stated depth; the distractors lie on the roomier side of it.
    assert abs(s.needle_spans[0][0] / len(s.context) - depth) <= 0.02
    assert s.distractors == values[1:]  # the needles not asked for, so a report can tell their values apart
    assert s == make_sample("multikey", Words(), 2000, depth, seed=11)  # deterministic from the seed
    assert score(s.answers, s.metric, f" {values[0]}.") == 1.0  # a distractor's number scores 0
    assert all(score(s.answers, s.metric, f" {v}.") == 0.0 for v in values[1:])


@pytest.mark.parametrize("tok,task,budget", [(Words(), "niah_essay", 900), (Chars(), "multikey", 2500),
                                             (Chars(), "niah_number", 700), (Words(), "passkey", 40),
                                             (Marked(), "multikey", 900)])
def test_fit_finds_the_largest_unit_count_that_fits(tok, task, budget):
    # Words and Chars count a context by its words (their sum is exact), Marked encodes it whole.
    assert (tasks._word_counts(tok) is None) == isinstance(tok, Marked)
    parts = tasks.TASKS[task].build(random.Random(5), 0.3)
    fixed = 7
    context, _ = tasks._fit(tok, budget, fixed, parts, random.Random(9))
    rng = random.Random(9)
    units = [parts.filler(rng, i) for i in range(budget)]
    size = lambda n: count_tokens(tok, tasks._build(units[:n], parts.needles, parts.depths)[0]) + fixed  # noqa: E731
    best = 0
    while size(best + 1) <= budget:  # the brute force: one unit more at a time
        best += 1
    assert all(size(n) > budget for n in range(best + 1, best + 4))
    assert context == tasks._build(units[:best], parts.needles, parts.depths)[0]


def test_word_sums_only_at_clean_spaces():
    words = {}
    assert tasks._summed_count(Chars(), words, "ab cd.\n\nef g") == len("ab cd.\n\nef g")
    for text in ("a  b", " a", "a ", "a \nb", "a\n b"):  # a space beside whitespace or an end: no clean cut
        assert tasks._summed_count(Chars(), words, text) is None
    assert tasks._count_context(Chars(), "a  b") == 4  # then encoded whole


# sha256 (first 16 hex) of two samples' prompts and answers per task, made before samples recorded their
# distractors: recording them must leave every prompt as it was, so later runs pair with earlier ones.
PROMPT_HASHES = {
    "passkey": "d936b775f2dd4902",
    "niah_number": "827ae57ea63d3118",
    "niah_uuid": "41b65326d140733b",
    "niah_word": "9bd74932cc2eeedb",
    "niah_essay": "e7046b809f714343",
    "multikey": "98c0642fcc482864",
    "multivalue": "5dfede8edb88db8e",
    "multiquery": "1983da019f63028d",
    "variable_tracking": "9d32cfd669c002ef",
    "common_words": "af42482739138ba9",
}


@pytest.mark.parametrize("task", list(tasks.TASKS))
def test_prompts_unchanged_by_recording_distractors(task):
    h = hashlib.sha256()
    for length, depth, seed in ((600, 0.3, 0), (1500, 0.9, 4)):
        s = make_sample(task, Words(), length, depth, seed, reserve=20)
        h.update(json.dumps([s.context, s.question, s.answers, s.answer_prefix, s.needle_spans]).encode())
        needles = [s.context[a:b] for a, b in s.needle_spans]
        for d in s.distractors:  # each one in a needle, and not an answer
            assert d not in s.answers and any(d in n for n in needles[1:])
    assert h.hexdigest()[:16] == PROMPT_HASHES[task]
    assert bool(s.distractors) == (task in ("multikey", "multiquery"))  # the tasks with needles not asked for


def test_threaded_samples_are_the_serial_ones():
    args = (["niah_essay", "multikey"], Chars(), [600, 1200], [0.0, 0.5, 1.0], 2, 3)
    assert make_samples(*args, reserve=9, workers=4) == make_samples(*args, reserve=9, workers=1)


# ---------------------------------------------------------------------------------------------
# Paired comparison


def _run(tmp_path, name, scores, prefill=None):
    """A run dir; `scores`: {(task, length, seed): score}; prefill: seconds per sample (metrics)."""
    rows = [{"task": t, "length": L, "depth": 0.5, "seed": s, "score": sc,
             "metrics": {} if prefill is None else {"prefill_seconds": prefill(L, s), "decode_seconds": 0.01}}
            for (t, L, s), sc in scores.items()]
    report.write_run(tmp_path / name, rows, {"strategy": name, "format": "completion"}, per_task_heatmaps=False)
    return tmp_path / name


def test_paired_kept_share_per_task_and_length(tmp_path, capsys):
    keys = [(t, L, s) for t in ("multikey", "niah_essay") for L in (16384, 30720) for s in range(5)]
    dense = {k: 1.0 for k in keys}
    dense[("multikey", 30720, 0)] = dense[("multikey", 30720, 1)] = 0.0  # dense: 3 of 5 right there
    star = dict(dense)
    star[("multikey", 30720, 2)] = 0.0  # loses one dense got right ...
    star[("multikey", 30720, 0)] = 1.0  # ... and gains one dense missed
    star[("niah_essay", 16384, 4)] = 0.5  # partial credit is not right
    apb = {k: 1.0 for k in keys}
    d = _run(tmp_path, "dense", dense, prefill=lambda L, s: L / 1e5 + (9.0 if s == 0 else 0.0))  # s 0: compiling
    st = _run(tmp_path, "star", star, prefill=lambda L, s: L / 2e5)
    ap = _run(tmp_path, "apb", apb)

    summary = report.compare_summary([st, d, ap])
    assert summary["reference"] == "dense" and summary["samples"] == 20
    ps = summary["runs"]["star"]["paired"]
    no_losses = dict.fromkeys(report.LOSS_CLASSES, 0)
    assert ps["multikey"]["30720"] == {"n": 5, "of": 3, "right": 2, "kept": pytest.approx(2 / 3), "gained": 1,
                                       "b": 1, "c": 1, "mcnemar_p": 1.0, "losses": {**no_losses, "absent": 1}}
    assert ps["niah_essay"]["16384"] == {"n": 5, "of": 5, "right": 4, "kept": 0.8, "gained": 0, "b": 1, "c": 0,
                                         "mcnemar_p": 1.0, "losses": {**no_losses, "absent": 1}}
    assert ps["multikey"]["16384"]["kept"] == 1.0
    assert ps["all"]["30720"] == {"n": 10, "of": 8, "right": 7, "kept": 7 / 8, "gained": 1, "b": 1, "c": 1,
                                  "mcnemar_p": 1.0, "losses": {**no_losses, "absent": 1}}
    assert ps["all"]["all"] == {"n": 20, "of": 18, "right": 16, "kept": 16 / 18, "gained": 1, "b": 2, "c": 1,
                                "mcnemar_p": 1.0, "losses": {**no_losses, "absent": 2}}  # no outputs: absent
    assert summary["runs"]["apb"]["paired"]["all"]["all"]["kept"] == 1.0
    assert summary["runs"]["apb"]["paired"]["multikey"]["30720"]["gained"] == 2
    assert "paired" not in summary["runs"]["dense"] or summary["runs"]["dense"]["paired"] == {}
    # unpaired accuracies beside them
    assert summary["runs"]["dense"]["accuracy"]["multikey"]["30720"] == pytest.approx(0.6)
    assert summary["runs"]["star"]["accuracy"]["niah_essay"]["16384"] == pytest.approx(0.9)
    # median prefill per length: the compiling first sample does not move it
    assert summary["runs"]["dense"]["prefill_seconds"]["16384"] == pytest.approx(0.16384)
    assert summary["runs"]["star"]["prefill_seconds"]["30720"] == pytest.approx(0.1536)
    assert summary["runs"]["apb"]["prefill_seconds"]["30720"] is None

    table = report.compare_table([st, d, ap])
    assert "| multikey | 30720 | 5 | 60 | 60 | 66.7 (2/3) +1 | 1 | 100 | 100.0 (3/3) +2 | 0.5 |" in table
    assert "| niah_essay | 16384 | 5 | 100 | 90 | 80.0 (4/5) | 1 | 100 | 100.0 (5/5) | 1 |" in table
    assert "| **all tasks** | all | 20 | 90 | 88 | 88.9 (16/18) +1 | 1 | 100 | 100.0 (18/18) +2 | 0.5 |" in table
    assert "| star | all | 2 | 2 | 0 | 0 | 0 | 0 |" in table and "| apb | 16384 | 0 | 0 | 0 | 0 | 0 | 0 |" in table
    assert "| 16384 | 0.164 | 0.082 | 0.50 | – | – |" in table

    spec = importlib.util.spec_from_file_location("eval_cli_paired", ROOT / "starshard" / "commands" / "eval.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    assert cli.main(["--compare", str(d), str(st), "--out", str(tmp_path / "cmp")]) == 0
    assert "66.7 (2/3) +1" in capsys.readouterr().out
    saved = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert saved["runs"]["star"]["paired"]["all"]["all"]["right"] == 16


# ---------------------------------------------------------------------------------------------
# --time-limit: a run cut short keeps whole seeds


class SlowReader:
    """Answers every needle (echoes the context) and takes `pause` seconds a sample."""

    pause = 0.0

    def __init__(self, path=None, **kwargs):
        self.tokenizer = Words()

    def generate(self, *, context, question, max_new_tokens, temperature, raw=False):
        time.sleep(self.pause)
        return SimpleNamespace(text=context, token_ids=[], metrics={})


class Slow(SlowReader):
    pause = 1.0  # against --time-limit 1.5: the second sample starts at ~1 s, the third would at ~2 s


def test_time_limit_writes_what_ran_seed_by_seed(tmp_path):
    spec = importlib.util.spec_from_file_location("eval_cli_limit", ROOT / "starshard" / "commands" / "eval.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    common = ["--tasks", "niah_essay,multikey", "--lengths", "300", "--depths", "0.5", "--samples-per-cell", "3",
              "--max-new-tokens", "8", "--no-progress", "--format", "completion"]
    assert cli.main(common + ["--out", str(tmp_path / "all")], llm_cls=SlowReader) == 0
    rows = [json.loads(x) for x in (tmp_path / "all" / "samples.jsonl").read_text().splitlines()]
    assert [r["seed"] for r in rows] == [0, 0, 1, 1, 2, 2]  # every task's seed 0, then seed 1, ...
    assert json.loads((tmp_path / "all" / "summary.json").read_text())["stopped_early"] is None
    assert cli.main(common + ["--out", str(tmp_path / "cut"), "--time-limit", "1.5"], llm_cls=Slow) == 0
    cut = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert cut["summary"]["samples"] == 2 and cut["stopped_early"] == "--time-limit: 2 of 6 samples ran"
    assert {r["task"] for r in map(json.loads, (tmp_path / "cut" / "samples.jsonl").read_text().splitlines())} == \
        {"niah_essay", "multikey"}
    with pytest.raises(SystemExit):
        cli.parse_args(common + ["--out", "x", "--time-limit", "-1"])
    made = []
    real_make = cli.make_samples
    cli.make_samples = lambda *a, **k: made.append(len(k["skip"])) or real_make(*a, **k)
    assert cli.main(common + ["--out", str(tmp_path / "cut"), "--resume"], llm_cls=SlowReader) == 0  # the rest
    assert made == [2]  # the two samples the cut run holds are not made again
    again = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert again["resumed"] == 2 and again["stopped_early"] is None and again["summary"]["samples"] == 6
    resumed = [json.loads(x) for x in (tmp_path / "cut" / "samples.jsonl").read_text().splitlines()]
    assert sorted(map(report.row_key, resumed)) == sorted(map(report.row_key, rows))  # each sample once
    assert {report.row_key(r): r["output"] for r in resumed} == {report.row_key(r): r["output"] for r in rows}
    with pytest.raises(SystemExit, match="holds another run .*format 'completion' there, 'chat' here"):
        cli.main([*common[:-2], "--format", "chat", "--out", str(tmp_path / "cut"), "--resume"], llm_cls=SlowReader)


# ---------------------------------------------------------------------------------------------
# Paired significance and the losses' classes


@pytest.mark.parametrize("b,c,p", [(5, 0, 0.0625), (10, 2, 0.03857421875), (0, 0, 1.0), (1, 0, 1.0), (3, 3, 1.0),
                                   (30, 0, 2 / 2 ** 30), (20, 5, 2 * (1 + 25 + 300 + 2300 + 12650 + 53130) / 2 ** 25)])
def test_mcnemar_exact_p(b, c, p):
    assert report.mcnemar_p(b, c) == pytest.approx(p, rel=1e-12)
    assert report.mcnemar_p(c, b) == report.mcnemar_p(b, c)


def _loss(task, answers, output, **extra):
    row = {"task": task, "answers": answers, "output": output, **extra}
    assert score(answers, "all", output) < 1.0  # a loss: the scorer did not find every answer
    return report.loss_class(row)


def test_loss_classes():
    mk = ["1600074"]
    assert _loss("multikey", mk, " I could not find it.") == "absent"
    assert _loss("multikey", mk, "") == "absent"
    assert _loss("multikey", mk, " 3. It is often said") == "absent"  # too short to be a 7-digit value
    assert _loss("multikey", mk, " 2530531.", distractors=["7038352", "2530531", "1111111"]) == "distractor"
    assert _loss("multikey", mk, " 2530531.") == "wrong value"  # an old row: distractors unknown
    assert _loss("multikey", mk, " 2530531.", distractors=["7038352"]) == "wrong value"
    assert _loss("niah_essay", mk, " 160074.") == "wrong value"  # a digit lost
    assert _loss("multikey", mk, " 1,600,074.") == "format"
    assert _loss("multikey", mk, " 1600 074. Nobody") == "format"
    assert _loss("multikey", mk, " 1 600 074") == "format"
    uid = ["0b6f5d8e-3c2a-4f1b-9a7e-5d4c3b2a1f0e"]
    assert _loss("niah_uuid", uid, " 0B6F5D8E3C2A4F1B9A7E5D4C3B2A1F0E") == "format"
    assert _loss("niah_uuid", uid, " 1b6f5d8e-3c2a-4f1b-9a7e-5d4c3b2a1f0e") == "wrong value"
    assert _loss("niah_word", ["mango"], " The secret word assigned to icy-hammock is kiwi.") == "wrong value"
    assert _loss("niah_word", ["mango"], " The secret word assigned to icy-hammock is unknown.") == "absent"
    vt = ["XMUHK", "DUPDM", "TSKIP", "LTTRO"]
    assert _loss("variable_tracking", vt, " TSKIP and LTTRO. The variables equal to 32446 are") == "partial"
    assert _loss("variable_tracking", vt, " ABCDE and FGHIJ.") == "wrong value"
    assert _loss("variable_tracking", vt, " The variables equal to 32446 are none.") == "absent"
    mv = ["1600074", "2530531", "7038352", "4188571"]
    assert _loss("multivalue", mv, " 1,600,074, 2530531, 7038352 and 4 188 571.") == "format"
    assert _loss("multivalue", mv, " 1,600,074 and 9999999.") == "partial"
    cw = ["kiwi", "mango", "basket", "ribbon", "yak"]
    assert _loss("common_words", cw, " kiwi, mango, basket, ribbon, candle") == "partial"
    assert _loss("common_words", cw, " candle, desert") == "wrong value"


def test_compare_reports_mcnemar_and_losses(tmp_path):
    """Dense answers all 12 multikey samples; the strategy misses 6 of them in four ways and gains none."""
    dist = ["7038352", "2530531", "5083981"]
    outs = {0: " 7038352.", 1: " 2530531.", 2: " nothing", 3: " 1,600,074.", 4: " 9999999.", 5: " 7038352."}
    rows = {"dense": [], "star": []}
    for seed in range(12):
        for name in rows:
            out = outs.get(seed, " 1600074.") if name == "star" else " 1600074."
            extra = {} if seed == 5 else {"distractors": dist}  # seed 5: as an old run wrote it
            rows[name].append({"task": "multikey", "length": 16384 if seed < 8 else 30720, "depth": 0.5, "seed": seed,
                               "answers": ["1600074"], "output": out, "score": score(["1600074"], "all", out),
                               "metrics": {}, **extra})
    rows["star"].append({**rows["star"][-1], "seed": 12, "score": 1.0})  # only in one run: left out
    dirs = []
    for name, rs in rows.items():
        report.write_run(tmp_path / name, rs, {"strategy": name, "format": "chat"}, per_task_heatmaps=False)
        dirs.append(tmp_path / name)

    cell = report.compare_summary(dirs)["runs"]["star"]["paired"]["multikey"]["16384"]
    assert (cell["b"], cell["c"], cell["of"]) == (6, 0, 8)
    assert cell["mcnemar_p"] == pytest.approx(2 / 64)
    assert cell["losses"] == {"absent": 1, "distractor": 2, "wrong value": 2, "format": 1, "partial": 0}
    table = report.compare_table(dirs)
    assert "| multikey | 16384 | 8 | 100 | 25 | 25.0 (2/8) | 0.031 |" in table
    assert "| **all tasks** | all | 12 | 100 | 50 | 50.0 (6/12) | 0.031 |" in table
    assert "| strategy | length | losses | absent | distractor | wrong value | format | partial |" in table
    assert "| star | 16384 | 6 | 1 | 2 | 2 | 1 | 0 |" in table and "| star | 30720 | 0 | 0 | 0 | 0 | 0 | 0 |" in table
    assert "| star | all | 6 | 1 | 2 | 2 | 1 | 0 |" in table
    assert "These runs record none" not in table


# ---------------------------------------------------------------------------------------------
# Outcomes: a summary.json alone pairs and resumes


def test_summary_alone_pairs_as_the_samples(tmp_path):
    """A run directory reduced to its summary.json (what a repository keeps) compares as the full one: the same
    paired shares, McNemar p, loss classes and accuracies; partial scores, depth-less tasks and seeds with gaps
    come back exactly."""
    dist = ["7038352", "2530531", "5083981"]
    outs = [" 7038352.", " nothing", " 1,600,074.", " 9999999.", " 1600074.", " 1600074."]
    vt = ["XMUHK", "DUPDM", "TSKIP", "LTTRO"]
    rows = {"dense": [], "star": []}
    for name in rows:
        for i, seed in enumerate([0, 1, 2, 3, 4, 5, 1000, 1001, 1003]):  # gaps between the seeds
            out = outs[i % len(outs)] if name == "star" else " 1600074."
            rows[name].append({"task": "multikey", "length": 16384, "depth": 0.25, "seed": seed, "answers": ["1600074"],
                               "distractors": dist, "output": out, "score": score(["1600074"], "all", out)})
            vout = " TSKIP and LTTRO." if name == "star" and i % 2 else " XMUHK DUPDM TSKIP LTTRO"
            rows[name].append({"task": "variable_tracking", "length": 30720, "depth": None, "seed": seed, "answers": vt,
                               "output": vout, "score": score(vt, "all", vout)})
    full, alone = [], []
    for name, rs in rows.items():
        report.write_run(tmp_path / name, rs, {"strategy": name, "format": "completion"}, per_task_heatmaps=False)
        (tmp_path / f"{name}_alone").mkdir()
        (tmp_path / f"{name}_alone" / "summary.json").write_bytes((tmp_path / name / "summary.json").read_bytes())
        full.append(tmp_path / name)
        alone.append(tmp_path / f"{name}_alone")
        assert report.is_run(tmp_path / f"{name}_alone")
        back = report.load_run(tmp_path / f"{name}_alone").rows
        assert sorted(map(report.row_key, back)) == sorted(map(report.row_key, rs))
        assert report.summarize(back) == report.summarize(rs)
    assert {r["score"] for r in report.load_run(alone[1]).rows} == {0.0, 0.5, 1.0}  # two of four names: 0.5

    def paired(dirs):
        runs = report.compare_summary(dirs)["runs"]
        return {n: (r["accuracy"], r["paired"]) for n, r in runs.items()}
    assert paired(alone) == paired(full)
    cell = paired(alone)["star"][1]["multikey"]["16384"]
    assert cell["losses"] == {"absent": 2, "distractor": 2, "wrong value": 1, "format": 2, "partial": 0}
    assert paired(alone)["star"][1]["variable_tracking"]["30720"]["losses"]["partial"] == 4
    assert report.compare_table(alone).split("Prefill")[0] == report.compare_table(full).split("Prefill")[0]
    # a directory with neither samples nor outcomes is refused, naming both
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "summary.json").write_text(json.dumps({"strategy": "x"}))
    assert not report.is_run(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="no samples.jsonl, and no summary.json with the samples' outcomes"):
        report.load_run(tmp_path / "empty")
    with pytest.raises(ValueError, match="holds a seed twice"):
        report.outcomes(rows["dense"] + rows["dense"][:1])


def test_resume_from_a_summary_alone(tmp_path):
    """A run cut by --time-limit, of which only summary.json was kept, resumes: its samples are not made again,
    and the whole run then holds each sample once."""
    spec = importlib.util.spec_from_file_location("eval_cli_alone", ROOT / "starshard" / "commands" / "eval.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    common = ["--tasks", "niah_essay,multikey", "--lengths", "300", "--depths", "0.5", "--samples-per-cell", "3",
              "--max-new-tokens", "8", "--no-progress", "--format", "completion"]
    assert cli.main(common + ["--out", str(tmp_path / "cut"), "--time-limit", "1.5"], llm_cls=Slow) == 0
    kept = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert kept["summary"]["samples"] == 2 and sum(len(c["codes"]) for c in kept["outcomes"].values()) == 2
    (tmp_path / "cut" / "samples.jsonl").unlink()
    made = []
    real_make = cli.make_samples
    cli.make_samples = lambda *a, **k: made.append(sorted(k["skip"])) or real_make(*a, **k)
    assert cli.main(common + ["--out", str(tmp_path / "cut"), "--resume"], llm_cls=SlowReader) == 0
    assert made == [sorted(map(report.row_key, report.outcome_rows(kept["outcomes"])))]
    again = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert again["resumed"] == 2 and again["summary"]["samples"] == 6 and again["summary"]["overall"] == 1.0
    keys = sorted(map(report.row_key, report.outcome_rows(again["outcomes"])))
    assert len(keys) == len(set(keys)) == 6
