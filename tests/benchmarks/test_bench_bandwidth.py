"""The MoE bench's bytes bound: the HBM figure it divides by comes from the GPU it runs on, or from the flag."""
import argparse
import json

import pytest
import torch

from starshard.benchmarks import common, moe


@pytest.mark.parametrize("name, expected", [
    ("NVIDIA H200", 4.8e12), ("NVIDIA H100 80GB HBM3", 3.35e12), ("NVIDIA H100 NVL", 3.9e12),
    ("NVIDIA H100 PCIe", 2.0e12), ("NVIDIA A100-SXM4-80GB", 2.039e12), ("NVIDIA A100-PCIE-40GB", 1.555e12),
    ("NVIDIA GeForce RTX 4090", None),
])
def test_nominal_hbm_bandwidth_by_device_name(monkeypatch, name, expected):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert common.nominal_hbm_bandwidth(torch.device("cuda", 0)) == expected


def test_no_nominal_bandwidth_on_the_cpu():
    assert common.nominal_hbm_bandwidth(torch.device("cpu")) is None


def _moe_args(extra):
    p = argparse.ArgumentParser()
    moe.add_arguments(p)
    return p.parse_args(["--random-weights", "tiny-moe", "--device", "cpu", "--dtype", "float32", "--prefill-lengths",
                         "16", "--decode-contexts", "16", "--decode-steps", "2", "--repeats", "1", "--warmup", "0",
                         "--skip-hf", *extra])


@pytest.mark.parametrize("flag, bound", [([], False), (["--hbm-bandwidth", "2e12"], True)])
def test_moe_bench_bound_on_the_cpu(tmp_path, flag, bound):
    out = tmp_path / "moe.json"
    moe.run(_moe_args([*flag, "--out", str(out)]))
    r = json.loads(out.read_text())
    step = r["decode"][0]
    if bound:  # the flag's figure, and the ratio it gives
        assert r["hbm_bytes_per_second"] == 2e12 and r["hbm_bandwidth_source"] == "--hbm-bandwidth"
        assert step["bytes_bound_seconds"] == pytest.approx(step["bytes_read"]["total"] / 2e12)
        assert step["measured_over_bytes_bound"] == pytest.approx(step["step_seconds"] / step["bytes_bound_seconds"])
    else:  # no HBM figure on the CPU: no bound rather than a made-up one
        assert r["hbm_bytes_per_second"] is None and r["hbm_bandwidth_source"] is None
        assert step["bytes_bound_seconds"] is None and step["measured_over_bytes_bound"] is None
