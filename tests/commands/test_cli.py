"""The main job end to end: launch/infer.py in one process and under torchrun with a CP group."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.hf_models import make_hf_model

ROOT = Path(__file__).resolve().parents[2]


def run(args, nproc=1):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(ROOT / "launch" / "infer.py")]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *cmd[1:]]
    p = subprocess.run(cmd + args, capture_output=True, text=True, env=env, timeout=300)
    return p


def test_help_explains_every_flag():
    p = run(["--help"])
    assert p.returncode == 0
    for flag in ("--model", "--prompt-file", "--context-file", "--question", "--raw", "--max-new-tokens",
                 "--temperature", "--top-p", "--top-k", "--seed", "--dtype", "--device", "--json",
                 "--cp", "--cp-strategy", "--block-size", "--anchor-size", "--tp", "--pp"):
        assert flag in p.stdout


def test_text_prompt_without_tokenizer_is_refused(tmp_path):
    _, path = make_hf_model("llama", tmp_path)  # random weights, no tokenizer files
    prompt = tmp_path / "p.txt"
    prompt.write_text("x")
    p = run(["--model", str(path), "--prompt-file", str(prompt), "--json"])
    assert p.returncode != 0 and "no tokenizer" in p.stderr


@pytest.mark.slow
def test_cli_cp_ring_on_default_model(tmp_path):
    prompt = tmp_path / "p.txt"
    prompt.write_text("The quick brown fox jumps over the lazy dog. " * 40 + "What animal jumps?")
    args = ["--prompt-file", str(prompt), "--max-new-tokens", "6", "--json"]
    single = run(args)
    assert single.returncode == 0, single.stderr[-2000:]
    ring = run(args + ["--cp", "2", "--cp-strategy", "ring"], nproc=2)
    assert ring.returncode == 0, ring.stderr[-2000:]
    a, b = json.loads(single.stdout.strip().splitlines()[-1]), json.loads(ring.stdout.strip().splitlines()[-1])
    assert a["token_ids"] == b["token_ids"] and len(a["token_ids"]) > 0
    assert len(ring.stdout.strip().splitlines()) == 1  # only rank 0 prints


def test_bad_layout_is_refused_before_any_collective():
    p = run(["--cp", "2", "--cp-strategy", "ring", "--max-new-tokens", "1"])  # one process, cp=2
    assert p.returncode != 0 and "not a multiple of tp*pp*cp" in p.stderr
