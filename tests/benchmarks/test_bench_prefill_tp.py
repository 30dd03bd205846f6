"""launch/bench.py prefill --tp: a tensor-parallel prefill under gloo reports the layout's FLOP model at
rates it measured (GEMM, attention, the tp all-reduce) and the planner's per-rank memory plan;
--plan-only plans without loading; a tp layout on one CP rank needs --cp-strategy dense."""
import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from starshard.benchmarks import prefill
from starshard.planner import Layout, Workload, plan_json, plan_memory
from starshard.presets import preset_config
from starshard.strategies.dense import dense_flops
from starshard.strategies.flops import predicted_seconds, tp_flops

BENCH = str(Path(__file__).resolve().parents[2] / "launch" / "bench.py")


def test_bench_prefill_tp2_reports_flop_model_and_plan(tmp_path):
    out = tmp_path / "tp2.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", BENCH, "prefill",
           "--random-weights", "tiny", "--tp", "2", "--cp-strategy", "dense", "--lengths", "100", "--repeats", "1",
           "--warmup", "0", "--device", "cpu", "--dtype", "float32", "--decode-steps", "2", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    res = json.loads(out.read_text())
    assert res["tp"] == 2 and res["cp"] == 1
    row = res["results"][0]
    fm, rates = row["flop_model"], row["flop_model"]["rates"]
    assert rates["allreduce_bytes_per_s"] > 0 and rates["gemm_flops_per_s"] > 0 and rates["attention_flops_per_s"] > 0
    # the prediction is flops.tp_flops of the dense model read at the JSON's own rates
    (want,) = tp_flops(preset_config("tiny"), dense_flops(preset_config("tiny"), 100), 2, dtype_bytes=4)
    assert fm["allreduce_bytes"] == want.tp_bytes and fm["gemm_flops"] == want.linear
    assert fm["seconds"] == pytest.approx(predicted_seconds([want], rates["gemm_flops_per_s"],
                                                            rates["attention_flops_per_s"],
                                                            allreduce_bytes_per_s=rates["allreduce_bytes_per_s"]))
    assert row["measured_over_flop_model"] == pytest.approx(row["prefill_seconds"] / fm["seconds"])
    plan = plan_memory(preset_config("tiny"), Layout(2), Workload(100, None, 2 + 8, dtype_bytes=4))
    assert row["memory_plan"] == plan_json(plan, None, None)
    assert row["decode"]["step_seconds"] > 0


def test_bench_prefill_plan_only_loads_nothing(tmp_path):
    out = tmp_path / "plan.json"
    cmd = [sys.executable, BENCH, "prefill", "--random-weights", "llama-3.1-70b", "--tp", "2", "--cp", "2",
           "--cp-strategy", "ring", "--fp8", "linear,kv", "--lengths", "131072", "--decode-steps", "8",
           "--memory-limit-gb", "72", "--plan-only", "--device", "cpu", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    (p,) = json.loads(out.read_text())["plans"]
    assert p["length"] == 131072 and p["layout"] == {"tp": 2, "pp": 1, "cp": 2, "strategy": "ring"}
    assert p["fp8"] == ["linear", "kv"] and p["limit_bytes"] == 72 * 2**30 and p["fits"]


def test_bench_prefill_tp_on_one_cp_rank_needs_dense():
    ap = argparse.ArgumentParser()
    prefill.add_arguments(ap)
    assert "--cp-strategy dense" in prefill.check(ap.parse_args(["--tp", "2", "--random-weights", "tiny"]))
    assert prefill.check(ap.parse_args(["--tp", "2", "--cp-strategy", "dense", "--random-weights", "tiny"])) is None
    assert prefill.check(ap.parse_args(["--tp", "2", "--cp", "2", "--random-weights", "tiny"])) is None
    assert "--tp must be >= 1" in prefill.check(ap.parse_args(["--tp", "0", "--random-weights", "tiny"]))


def test_bench_prefill_plans_the_study_mode_it_runs():
    """--cp 1 with --num-blocks / --apb-hosts runs a strategy's study mode (its blocks in turn): the plan is that
    mode's, not the whole sequence's; --sparse makes every Star block run [anchor; block] square."""
    ap = argparse.ArgumentParser()
    prefill.add_arguments(ap)
    cfg = preset_config("tiny")

    def rows(*argv):
        args = ap.parse_args(["--random-weights", "tiny", "--dtype", "float32", *argv])
        return prefill.memory_plan(cfg, args, 400, None, False, None)["stages"][0]["rows"]

    whole = rows()
    assert rows("--cp-strategy", "star", "--num-blocks", "4") == 100 < whole == 400  # the anchor read stored
    assert rows("--cp-strategy", "star", "--num-blocks", "4", "--sparse", "minference") == 200
    assert rows("--cp-strategy", "apb", "--apb-hosts", "4") < whole / 2
