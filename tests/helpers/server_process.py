"""A `launch/serve.py` server as a separate process, for the tests that drive a real one (tests/server/): started
in its own session with its stdout / stderr in files, ready once it printed its "serving NAME on URL" line
and /health answers, and killed as a whole (torchrun's workers included)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVE = str(ROOT / "launch" / "serve.py")
MODEL = "SmolLM2-135M-Instruct"
READY_S = 240  # model load on 2 busy cores
READY = re.compile(r"serving (\S+) on (http://\S+)")


def server_env(**extra) -> dict:
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    for name in ("STARSHARD_FAULT_INJECT", "STARSHARD_API_KEY"):
        env.pop(name, None)
    env.update(extra)
    return env


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for c in children(todo.pop()):
            out.append(c)
            todo.append(c)
    return out


def running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def environ_of(pid: int) -> dict:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            pairs = [x.split(b"=", 1) for x in f.read().split(b"\0") if b"=" in x]
    except OSError:
        return {}
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


class ServerProcess:
    """One server launch (plain or under torchrun) in its own session; stdout / stderr go to files."""

    def __init__(self, name: str, cmd: list[str], env: dict, logdir: Path):
        self.name, self.cmd = name, cmd
        self.out_path, self.err_path = logdir / f"{name}.out", logdir / f"{name}.err"
        self._out, self._err = open(self.out_path, "w"), open(self.err_path, "w")  # noqa: SIM115 (closed in kill)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=self._out,
                                     stderr=self._err, start_new_session=True)
        self.base: str | None = None

    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = READY_S) -> str:
        """The base URL once the server printed its address and /health answers; fails (with the
        server's stderr) if it exits or takes longer than `timeout`."""
        deadline = time.monotonic() + timeout
        while self.base is None:
            m = READY.search(self.stdout())
            if m:
                assert m.group(1) == MODEL, self.stdout()
                self.base = m.group(2)
                break
            if self.proc.poll() is not None:
                pytest.fail(f"{self.name} exited with {self.proc.returncode} before serving:\n{self.stderr()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"{self.name} did not print its address within {timeout:.0f} s:\n{self.stderr()[-3000:]}")
            time.sleep(0.2)
        r = httpx.get(f"{self.base}/health", timeout=10)
        assert r.status_code == 200 and r.json() == {"status": "ok"}, r.text
        return self.base

    def kill(self) -> None:
        """SIGKILL the launcher's process group and every descendant (torchrun puts its workers in
        sessions of their own), then reap, in bounded time."""
        if self.proc.poll() is None:
            pids = descendants(self.proc.pid)
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        self._out.close()
        self._err.close()
