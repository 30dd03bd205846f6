"""launch/bench.py prefill --fresh: after each length, lengths unequal to any run before (drawn from the 1/16 below
it), each timed cold and warm; a --fresh that the range cannot hold is refused before anything loads."""
import argparse
import json
import subprocess
import sys
from pathlib import Path

from starshard.benchmarks import prefill

BENCH = str(Path(__file__).resolve().parents[2] / "launch" / "bench.py")


def test_fresh_lengths_are_new_and_timed_twice(tmp_path):
    out = tmp_path / "fresh.json"
    cmd = [sys.executable, BENCH, "prefill", "--random-weights", "tiny", "--cp-strategy", "dense", "--lengths",
           "160,320", "--repeats", "1", "--warmup", "0", "--device", "cpu", "--dtype", "float32", "--decode-steps",
           "0", "--fresh", "3", "--fresh-seed", "5", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    rows = json.loads(out.read_text())["results"]
    drawn = [r["length"] for row in rows for r in row["fresh"]]
    assert len(drawn) == 6 and len(set(drawn)) == 6 and not {160, 320} & set(drawn)
    for row in rows:
        L = row["length"]
        assert all(L - L // 16 <= r["length"] < L for r in row["fresh"])
        assert all(r["first_seconds"] > 0 and r["second_seconds"] > 0 for r in row["fresh"])
        ratios = sorted(r["first_seconds"] / r["second_seconds"] for r in row["fresh"])
        assert row["fresh_first_over_second"] == ratios[1]


def test_fresh_needs_room_below_each_length():
    ap = argparse.ArgumentParser()
    prefill.add_arguments(ap)
    args = ["--random-weights", "tiny", "--lengths", "64,4096", "--fresh"]
    assert "64 has too few" in prefill.check(ap.parse_args(args + ["3"]))
    assert "--fresh must be >= 0" in prefill.check(ap.parse_args(args + ["-1"]))
    assert prefill.check(ap.parse_args(["--random-weights", "tiny", "--lengths", "4096", "--fresh", "3"])) is None
