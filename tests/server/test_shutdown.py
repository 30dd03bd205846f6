"""How the real server stops and fails to start (`launch/serve.py` as a separate process, the embedded
SmolLM2-135M-Instruct on CPU):

- a graceful stop keeps the cache: a server with --disk-cache-dir D stopped by a real SIGTERM or SIGINT
  writes the entries it holds to D and exits 0 without a traceback, and a restart on D serves another
  question on the same document from disk (`cached_tokens` covers the document); a stream still running
  when the server stops ends with an error event and [DONE];
- the same for a torchrun cp=2 ring group stopped by SIGTERM to torchrun, which passes it to every rank,
  restarted as one process: an exact layout's files are read by another (serving/kv_layout.py);
- a --port already in use is reported before the model loads.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from starshard.server.app import port_error
from tests.helpers.server_process import MODEL, ROOT, SERVE, ServerProcess, server_env

COLORS = ["red", "blue", "green", "grey", "brown", "white", "black", "pink"]
ANIMALS = ["fox", "dog", "cat", "owl", "bee", "ant", "elk", "yak", "cow", "pig", "hen", "rat", "bat", "eel"]


def document(seed: int, facts: int) -> str:
    """Facts like "The red fox is number 3." (~8 tokens each), different per seed."""
    return " ".join(f"The {COLORS[(i * 3 + seed) % 8]} {ANIMALS[(i + seed) % 14]} is number {(i * 7 + seed) % 97}."
                    for i in range(facts))


DOC = document(1, 150)  # ~1.2K tokens
OTHER_DOC = document(2, 30)


def messages(doc: str, question: str) -> list[dict]:
    return [{"role": "user", "content": f"{doc}\n\n{question}"}]


def document_tokens(doc: str, question: str) -> int:
    """The prompt's tokens before its question (the chat template's head and the document), as the server
    splits it."""
    from starshard.checkpoints.default import default_checkpoint
    from starshard.runtime.prompt import build_chat_prompt, load_tokenizer

    return build_chat_prompt(load_tokenizer(default_checkpoint(progress=False)), messages(doc, question)).context_len


def ask(base: str, doc: str, question: str) -> dict:
    r = httpx.post(f"{base}/v1/chat/completions", timeout=120,
                   json={"model": MODEL, "messages": messages(doc, question), "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def stop(server: ServerProcess, sig: signal.Signals, timeout: float = 90) -> int:
    """Send `sig` to the server's launcher (the server, or torchrun) and wait for it to end."""
    os.kill(server.proc.pid, sig)
    try:
        return server.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{server.name} still runs {timeout:g} s after {sig.name}:\n{server.stderr()[-3000:]}")


def stream_lines(base: str, lines: list[str], started: threading.Event) -> None:
    """A chat stream that runs for minutes (ignore_eos), its SSE data lines into `lines`; `started` once a
    token arrived."""
    body = {"model": MODEL, "messages": messages(OTHER_DOC, "Tell a long story."), "max_tokens": 4000,
            "ignore_eos": True, "stream": True, "temperature": 0}
    try:
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                if '"content":"' in line:
                    started.set()
    finally:
        started.set()


def kv_files(d: Path) -> set[str]:
    return {p.name for p in d.glob("*.kv")}


def written(log: str) -> int:
    """Entries the write-down reports written ("shutdown: wrote N cache entries"); 0 when it wrote nothing."""
    m = re.search(r"shutdown: wrote (\d+) cache entries", log)
    return int(m.group(1)) if m else 0


@pytest.mark.slow
def test_sigterm_and_sigint_write_the_cache_down_for_a_restart(tmp_path):
    disk = tmp_path / "kv"
    # no --disk-cache-gib: the default budget, logged
    cmd = [sys.executable, SERVE, "--port", "0", "--cache-gib", "0.2", "--disk-cache-dir", str(disk)]
    first = ServerProcess("first", cmd, server_env(), tmp_path)
    try:
        usage = ask(first.wait_ready(), DOC, "What number is the red fox?")
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        assert kv_files(disk) == set()  # nothing was evicted: the device alone holds the entry
        rc = stop(first, signal.SIGTERM)
    finally:
        first.kill()
    err = first.stderr()
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    assert re.search(r"disk tier: \S+, budget [\d.]+ GiB per rank \(of [\d.]+ GiB free", err), err[-3000:]
    assert written(err) == 1 and len(kv_files(disk)) == 1, err[-3000:]

    second = ServerProcess("second", cmd, server_env(), tmp_path)
    try:
        base = second.wait_ready()
        question = "Which animal is number 8?"
        usage = ask(base, DOC, question)
        assert usage["prompt_tokens_details"]["cached_tokens"] >= document_tokens(DOC, question) > 1000, usage
        # SIGINT (a terminal's Ctrl-C) writes down as well: at least the new document's entry. A stream
        # still running is given a few seconds (server/settings.py shutdown_grace_s), then ends with an error.
        before = kv_files(disk)
        ask(base, OTHER_DOC, question)
        lines, started = [], threading.Event()
        client = threading.Thread(target=stream_lines, args=(base, lines, started), daemon=True)
        client.start()
        assert started.wait(120) and lines, lines
        rc = stop(second, signal.SIGINT)
        client.join(30)
    finally:
        second.kill()
    err = second.stderr()
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    new = kv_files(disk) - before
    assert written(err) == len(new) >= 1, (err[-3000:], new)
    assert not client.is_alive() and lines[-1] == "data: [DONE]", lines[-3:]
    assert '"code":"engine_unavailable"' in lines[-2] and "the server is shutting down" in lines[-2], lines[-3:]


def _cp2(name: str, disk: Path, logs: Path) -> ServerProcess:
    """A torchrun cp=2 ring server on `disk`; each worker's own output also goes to files under logs/name."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "0", "--log-dir", str(logs / name), "--redirects", "3", "--tee", "3",
           SERVE, "--cp", "2", "--cp-strategy", "ring", "--port", "0", "--dist-timeout", "30", "--cache-gib", "0.2",
           "--disk-cache-dir", str(disk), "--disk-cache-gib", "0.5"]
    return ServerProcess(name, cmd, server_env(), logs.parent)


def worker_logs(logs: Path) -> dict[str, str]:
    """Each worker's stdout / stderr as torchrun's --log-dir keeps them (torchrun's own lines are not there)."""
    return {str(p.relative_to(logs)): p.read_text(errors="replace") for p in logs.glob("*/attempt_*/*/std*.log")}


@pytest.mark.slow
def test_sigterm_to_torchrun_writes_every_ranks_shard_down(tmp_path):
    if shutil.which("torchrun") is None:
        pytest.skip("torchrun is not on PATH")
    disk, logs = tmp_path / "kv", tmp_path / "logs"
    first = _cp2("cp2-first", disk, logs)
    try:
        ask(first.wait_ready(), DOC, "What number is the red fox?")
        stop(first, signal.SIGTERM)  # torchrun exits 1 (it reports the signal it got), once the ranks are done
    finally:
        first.kill()
    outs = worker_logs(logs / "cp2-first")
    assert len(outs) == 4 and not any("Traceback" in text for text in outs.values()), outs
    rank0 = next(text for name, text in outs.items() if name.endswith("/0/stderr.log"))
    assert written(rank0) == 1, rank0[-3000:]
    assert {name.rsplit("-", 1)[1] for name in kv_files(disk)} == {"r0.kv", "r1.kv"}, kv_files(disk)

    # restarted as one process on the same directory: it rebuilds its shard from both ranks' files
    cmd = [sys.executable, SERVE, "--port", "0", "--cache-gib", "0.2", "--disk-cache-dir", str(disk),
           "--disk-cache-gib", "0.5"]
    second = ServerProcess("one-process", cmd, server_env(), tmp_path)
    try:
        question = "Which animal is number 8?"
        usage = ask(second.wait_ready(), DOC, question)
        assert usage["prompt_tokens_details"]["cached_tokens"] >= document_tokens(DOC, question) > 1000, usage
    finally:
        second.kill()
    assert "Traceback" not in second.stderr(), second.stderr()[-3000:]


@pytest.mark.slow
def test_a_busy_port_is_reported_before_the_model_loads(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        # a --model that does not exist: had the model been loaded first, that would be the error
        r = subprocess.run([sys.executable, SERVE, "--port", str(port), "--model", str(tmp_path / "missing")],
                           cwd=ROOT, env=server_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"error: --port {port}: 127.0.0.1:{port} is already in use (another server?); stop it, or pick another "
        "--port (0: any free port)"], r.stderr


def test_port_error_names_the_flag():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        held.listen()
        assert port_error("127.0.0.1", port).startswith(f"--port {port}: 127.0.0.1:{port} is already in use")
    assert port_error("127.0.0.1", port) is None  # free again
    assert port_error("127.0.0.1", 0) is None  # any free port
    assert port_error("no-such-host.invalid", 8000).startswith("--host no-such-host.invalid: ")
