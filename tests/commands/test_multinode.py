"""Multi-node launch on one machine: two torchrun "nodes" over a loopback c10d rendezvous (gloo), a rank
that dies or hangs ending the job everywhere, and TOML run configs mirroring the CLI."""
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.mp_harness import _free_port

ROOT = Path(__file__).resolve().parents[2]
INFER = str(ROOT / "launch" / "infer.py")
TINY = ["--random-weights", "tiny", "--prompt-len", "64", "--max-new-tokens", "4", "--json", "--device", "cpu"]


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("STARSHARD_FAULT_INJECT", None)
    env.update(extra)
    return env


def _single(args):
    p = subprocess.run([sys.executable, INFER, *args], capture_output=True, text=True, env=_env(), timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _nodes(args, nnodes=2, nproc=1, env=None, timeout=180):
    """`nnodes` torchrun invocations of one job (distinct --node-rank, loopback c10d rendezvous) ->
    [(returncode, stdout, stderr, seconds)] per node."""
    port = _free_port()
    procs = []
    t0 = time.monotonic()
    for node in range(nnodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node-rank={node}",
               f"--nproc-per-node={nproc}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
               "--rdzv-id=starshard-test", "--max-restarts=0", INFER, *args]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=env or _env(), start_new_session=True))
    out = []
    try:
        for p in procs:
            so, se = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - t0)))
            out.append((p.returncode, so, se, time.monotonic() - t0))
    finally:
        for p in procs:  # a failure above must not leave ranks behind: end each torchrun's own process group
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return out


def _check_nodes_match(nodes, ref):
    for rc, so, se, _ in nodes:
        assert rc == 0, se[-3000:]
    printed = [json.loads(so.strip().splitlines()[-1]) for _, so, _, _ in nodes if so.strip()]
    assert len(printed) == 1 and sum(len(so.strip().splitlines()) for _, so, _, _ in nodes) == 1  # rank 0 only
    assert printed[0]["token_ids"] == ref["token_ids"] and len(ref["token_ids"]) == 4
    assert sum(se.count("timing: plan") for _, _, se, _ in nodes) == 1  # progress / timing from rank 0 only


def test_two_nodes_match_one_process():
    """torchrun --nnodes 2 (one process each, loopback c10d rendezvous) with --tp 2: the tokens of a
    one-process run."""
    _check_nodes_match(_nodes(TINY + ["--tp", "2", "--dist-timeout", "60"], nnodes=2, nproc=1), _single(TINY))


@pytest.mark.slow
def test_two_nodes_tp_inside_pp_across_match_one_process():
    """2 nodes x 2 processes, --tp 2 --pp 2: Megatron order puts each tp pair on one node (consecutive
    ranks) and the pipeline across the nodes; tokens equal a one-process run."""
    nodes = _nodes(TINY + ["--tp", "2", "--pp", "2", "--dist-timeout", "60"], nnodes=2, nproc=2)
    _check_nodes_match(nodes, _single(TINY))


def test_killed_rank_ends_every_node_with_one_message():
    """Rank 1 (on the other node) dies at decode step 2: both nodes exit non-zero, promptly, and the
    survivor says once what happened, without a traceback from our code."""
    env = _env(STARSHARD_FAULT_INJECT="1:2")
    nodes = _nodes(TINY + ["--tp", "2", "--dist-timeout", "30"], env=env, timeout=120)
    assert all(rc != 0 for rc, *_ in nodes), [n[2][-1500:] for n in nodes]
    assert max(t for *_, t in nodes) < 60  # a dead peer is noticed at once, well before the timeout
    err = "".join(se for _, _, se, _ in nodes)
    assert err.count("fault injected at step 2") == 1
    lines = [ln for ln in err.splitlines() if ln.startswith("error: rank ")]
    assert len(lines) == 1 and lines[0].startswith("error: rank 0: ")
    assert "the job is stopping on every rank" in lines[0]
    assert 'File "' + INFER not in err  # our ranks print no traceback


def test_bad_input_is_reported_once_before_any_collective():
    """A layout the model cannot take, on two nodes: every rank refuses it before the process group
    exists (exit 2), and the message appears once (rank 0), with no traceback."""
    nodes = _nodes(TINY + ["--tp", "2", "--max-new-tokens", "100000000"], timeout=120)
    assert all(rc != 0 for rc, *_ in nodes)
    err = "".join(se for _, _, se, _ in nodes)
    assert err.count("exceeds the model window") == 1 and 'File "' + INFER not in err, err[-2000:]


@pytest.mark.slow
def test_hung_rank_on_another_node_ends_the_job():
    """Rank 1 (the other node) hangs at decode step 1 outside any collective: rank 0 times out after
    --dist-timeout and exits with one line. The hung rank's node ends too: its torchrun agent when it
    loses the rendezvous store hosted by the other node, else the rank's own watchdog after
    2 x --dist-timeout + 10 s without progress (which one depends on which agent hosts the store)."""
    env = _env(STARSHARD_FAULT_INJECT="1:1:hang")
    nodes = _nodes(TINY + ["--tp", "2", "--dist-timeout", "5"], env=env, timeout=150)
    assert all(rc != 0 for rc, *_ in nodes), [n[2][-1500:] for n in nodes]
    assert max(t for *_, t in nodes) < 90
    lines = [ln for _, _, se, _ in nodes for ln in se.splitlines() if ln.startswith("error: rank ")]
    assert any(ln.startswith("error: rank 0: ") and "--dist-timeout=5" in ln for ln in lines), lines
    assert all(ln.startswith(("error: rank 0: ", "error: rank 1: no progress for")) for ln in lines), lines


def test_watchdog_ends_a_stuck_rank():
    """The watchdog alone: no heartbeat for longer than its limit -> one line and exit 1, in bounded time."""
    code = ("import sys, time; sys.path.insert(0, %r)\n"
            "from starshard.runtime.monitor import Watchdog; w = Watchdog(1.0, 3); w.start(); time.sleep(30)\n"
            ) % str(ROOT)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=60)
    assert p.returncode == 1 and time.monotonic() - t0 < 20
    assert p.stderr.strip().splitlines()[-1].startswith("error: rank 3: no progress for")


def test_fault_hook_parsing():
    from starshard.runtime.monitor import FaultInjection

    assert FaultInjection.from_env({}) is None
    assert FaultInjection.from_env({"STARSHARD_FAULT_INJECT": "3:7"}) == FaultInjection(3, 7, "exit")
    assert FaultInjection.from_env({"STARSHARD_FAULT_INJECT": "0:0:hang"}).mode == "hang"
    with pytest.raises(ValueError, match="RANK:STEP"):
        FaultInjection.from_env({"STARSHARD_FAULT_INJECT": "1:x"})
    FaultInjection(1, 2).maybe_fire(0, 2)  # another rank / step: nothing happens
    FaultInjection(1, 2).maybe_fire(1, 1)


def test_collective_failure_messages():
    from starshard.parallel.topology import collective_failure

    dead = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer")
    assert "closed its connection" in collective_failure(dead, 30)
    hung = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 6000ms for recv operation")
    assert "--dist-timeout=6" in collective_failure(hung, 6)
    assert collective_failure(KeyError("x"), 6) is None
    assert collective_failure(RuntimeError("shape mismatch [2, 3] vs [3, 2]"), 6) is None  # a bug keeps its traceback


# ---------------------------------------------------------------------------- run configs
def _infer_module():
    spec = importlib.util.spec_from_file_location("infer_cli", ROOT / "starshard" / "commands" / "infer.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "examples").glob("*.toml")))
def test_example_configs_plan(name, capsys):
    """Every shipped example parses and plans (no weights are loaded) within an 80 GB GPU."""
    infer = _infer_module()
    argv = ["--config", str(ROOT / "examples" / name), "--plan-only", "--json", "--memory-limit-gb", "72"]
    assert infer.main(argv) == 0
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plan["fits"] and plan["peak_bytes"] < 72 * 2**30


def test_config_values_flags_override_and_paths(tmp_path):
    infer = _infer_module()
    (tmp_path / "ctx.txt").write_text("some context")
    cfg = tmp_path / "run.toml"
    cfg.write_text('max-new-tokens = 7\n[parallel]\ntp = 2\npp_layers = [1, 1]\npp = 2\ncp-strategy = "ring"\n'
                   '[prompt]\ncontext-file = "ctx.txt"\nquestion = "Why?"\n[runtime]\njson = true\n')
    a = infer.parse_args(["--config", str(cfg)])
    assert (a.max_new_tokens, a.tp, a.pp, a.pp_layers, a.cp_strategy, a.json) == (7, 2, 2, [1, 1], "ring", True)
    assert a.context_file == tmp_path / "ctx.txt"  # relative to the config file
    b = infer.parse_args(["--config", str(cfg), "--tp", "1", "--max-new-tokens", "3"])
    assert (b.tp, b.max_new_tokens, b.pp) == (1, 3, 2)  # flags win over the file


@pytest.mark.parametrize("text,needle", [
    ("tpp = 2\n", "unknown key 'tpp'; valid keys:"),
    ("tp = \"two\"\n", "tp = 'two': not a valid value for --tp"),
    ("cp-strategy = \"zigzag\"\n", "--cp-strategy must be one of dense, ring, ulysses, usp, star, apb"),
    ("json = 1\n", "--json is a switch"),
    ("tp = 2\n[parallel]\ntp = 4\n", "[parallel] tp is set twice"),
    ("tp = [\n", "not valid TOML"),
])
def test_bad_config_is_refused_clearly(tmp_path, capsys, text, needle):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    with pytest.raises(SystemExit) as e:
        _infer_module().parse_args(["--config", str(cfg), "--plan-only"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err and "Traceback" not in err, err


def test_bad_config_from_the_command_line():
    """The same refusal through the real entry point: exit 2, the message, no traceback."""
    p = subprocess.run([sys.executable, INFER, "--config", str(ROOT / "no-such.toml")], capture_output=True,
                       text=True, env=_env(), timeout=60)
    assert p.returncode == 2 and "no-such.toml: no such file" in p.stderr and "Traceback" not in p.stderr


def test_bad_config_on_two_nodes_is_reported_once(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("tpp = 2\n")
    nodes = _nodes(["--config", str(cfg)] + TINY, timeout=120)
    assert all(rc != 0 for rc, *_ in nodes)
    assert "".join(se for _, _, se, _ in nodes).count("unknown key 'tpp'") == 1
