"""launch/slurm/*.sbatch on a real Slurm: a one-machine cluster (munged + slurmctld + slurmd on
localhost, everything under a temp dir, free ports) runs infer.sbatch with 2 tasks on CPU, and its
output must equal a one-process run. Needs Debian's slurm-wlm and munge (22.05 tested) and root
(slurmd starts job steps as the submitting user); skips naming what is missing otherwise."""
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "sinfo", "scontrol", "scancel", "srun")


def _missing() -> str | None:
    search = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    gone = [b for b in DAEMONS + CLIENTS if shutil.which(b, path=search) is None]
    if gone:
        return f"Slurm test needs {', '.join(gone)}: apt-get install -y --no-install-recommends slurm-wlm munge"
    if os.geteuid() != 0:
        return "Slurm test needs root: slurmd runs job steps as the submitting user"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _which(name: str) -> str:
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"]))


class LocalSlurm:
    """munged + slurmctld + slurmd on this machine, one node entry (this host), config and state in `d`."""

    def __init__(self, d: Path):
        self.d = d
        self.procs: list[subprocess.Popen] = []
        self.env = dict(os.environ, SLURM_CONF=str(d / "slurm.conf"))

    def _write_config(self) -> None:
        d = self.d
        for sub in ("state", "spool", "munge"):
            (d / sub).mkdir(mode=0o700)
        node = subprocess.run([_which("slurmd"), "-C"], capture_output=True, text=True, check=True).stdout
        node_line = next(ln for ln in node.splitlines() if ln.startswith("NodeName="))
        host = node_line.split()[0].split("=", 1)[1]
        self.host = host
        (d / "slurm.conf").write_text("\n".join([
            "ClusterName=starshard-test",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={d / 'munge' / 'munge.socket'}",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'spool'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'slurmd.pid'}",
            f"SlurmctldLogFile={d / 'slurmctld.log'}",
            f"SlurmdLogFile={d / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",  # no cgroups needed
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/builtin",
            "MpiDefault=none",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",  # the node line below is what slurmd -C found
            "SlurmdTimeout=30",
            "InactiveLimit=0",
            "KillWait=5",
            f"{node_line.split(' UpTime')[0]} NodeAddr=127.0.0.1 State=UNKNOWN",
            f"PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)

    def __enter__(self):
        self._write_config()
        m = self.d / "munge"
        self._start([_which("munged"), "--foreground", "--force", f"--key-file={m / 'munge.key'}",
                     f"--socket={m / 'munge.socket'}", f"--pid-file={m / 'munged.pid'}",
                     f"--log-file={m / 'munged.log'}", f"--seed-file={m / 'munged.seed'}"])
        self._wait(lambda: (m / "munge.socket").exists(), "munged socket", 20)
        conf = str(self.d / "slurm.conf")
        self._start([_which("slurmctld"), "-D", "-i", "-f", conf])
        self._start([_which("slurmd"), "-D", "-f", conf])
        self._wait(self._node_idle, "the node to come up idle", 60)
        return self

    def _start(self, cmd) -> None:
        log = open(self.d / (Path(cmd[0]).name + ".out"), "w")
        self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env))

    def _node_idle(self) -> bool:
        for p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args[0]} exited with {p.returncode}:\n{self.logs()}")
        r = subprocess.run([_which("sinfo"), "-h", "-o", "%t"], capture_output=True, text=True, env=self.env)
        return r.returncode == 0 and r.stdout.strip() == "idle"

    def _wait(self, ok, what: str, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if ok():
                return
            time.sleep(0.5)
        raise RuntimeError(f"timed out waiting for {what}:\n{self.logs()}")

    def logs(self) -> str:
        parts = []
        for f in sorted(self.d.rglob("*.log")) + sorted(self.d.glob("*.out")):
            parts.append(f"--- {f.name}\n" + f.read_text(errors="replace")[-2000:])
        return "\n".join(parts)

    def __exit__(self, *exc):
        for p in reversed(self.procs):  # our own daemons only, by their process handles
            if p.poll() is None:
                p.terminate()
        for p in reversed(self.procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return False

    def sbatch(self, script: str, sbatch_args: list[str], script_args: list[str], env: dict, timeout=300):
        """Submit, wait for the job to end -> (exit code, job output text, its state line).

        Polls scontrol every half second: `sbatch --wait` backs off to long sleeps and would double
        the test's time."""
        out = self.d / "job-%j.out"
        cmd = [_which("sbatch"), "--parsable", f"--output={out}", *sbatch_args, script, *script_args]
        p = subprocess.run(cmd, capture_output=True, text=True, env={**self.env, **env}, cwd=ROOT, timeout=60)
        assert p.returncode == 0, f"sbatch refused the job: {p.stderr}"
        job = p.stdout.strip().split(";")[0]
        end = time.monotonic() + timeout
        state = ""
        while time.monotonic() < end:
            state = subprocess.run([_which("scontrol"), "show", "job", job, "-o"], capture_output=True, text=True,
                                   env=self.env).stdout
            fields = dict(f.split("=", 1) for f in state.split() if "=" in f)
            if fields.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                code = int(fields.get("ExitCode", "1:0").split(":")[0]) or (fields["JobState"] != "COMPLETED")
                text = (self.d / f"job-{job}.out").read_text()
                return int(code), text, state
            time.sleep(0.5)
        subprocess.run([_which("scancel"), job], env=self.env)
        raise AssertionError(f"job {job} did not end within {timeout} s: {state}\n{self.logs()}")


JOB_ENV = {"STARSHARD_PYTHON": sys.executable, "STARSHARD_HOME": str(ROOT), "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore"}
TWO_TASKS = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--time=10"]
TINY = ["--random-weights", "tiny", "--prompt-len", "64", "--max-new-tokens", "4", "--json", "--device", "cpu",
        "--dist-timeout", "60"]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """One cluster for the module's tests; the daemons stop when they are done."""
    why = _missing()
    if why:
        pytest.skip(why)
    with LocalSlurm(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


def _script(name: str) -> str:
    return str(ROOT / "launch" / "slurm" / name)


@pytest.mark.slow
def test_infer_sbatch_two_tasks_matches_one_process(slurm):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    single = subprocess.run([sys.executable, str(ROOT / "launch" / "infer.py"), *TINY], capture_output=True,
                            text=True, env=env, timeout=120)
    assert single.returncode == 0, single.stderr[-2000:]
    ref = json.loads(single.stdout.strip().splitlines()[-1])
    rc, text, state = slurm.sbatch(_script("infer.sbatch"), TWO_TASKS, TINY + ["--tp", "2"], JOB_ENV)
    assert rc == 0, f"{state}\n--- job output\n{text}\n{slurm.logs()}"
    results = [json.loads(ln) for ln in text.splitlines() if ln.startswith("{")]
    assert len(results) == 1, text  # rank 0 alone prints the result
    assert results[0]["token_ids"] == ref["token_ids"] and len(ref["token_ids"]) == 4
    assert "master 127.0.0.1:" in text or f"master {slurm.host}:" in text  # rendezvous on the first host
    assert "NCCL_NVLS_ENABLE=0" in text and "timing: plan" in text


@pytest.mark.slow
def test_infer_sbatch_killed_rank_fails_the_job(slurm):
    """A rank that dies ends the whole job: non-zero exit, at most one message from the survivor
    (srun --kill-on-bad-exit may end it first)."""
    rc, text, state = slurm.sbatch(_script("infer.sbatch"), TWO_TASKS, TINY + ["--tp", "2"],
                                   {**JOB_ENV, "STARSHARD_FAULT_INJECT": "1:2"})
    assert rc != 0, text
    assert "fault injected at step 2" in text
    assert sum(ln.startswith("error: rank ") for ln in text.splitlines()) <= 1


@pytest.mark.slow
def test_bench_and_eval_sbatch(slurm, tmp_path):
    # bench.sbatch: the same launch logic around launch/bench.py (a 2-rank ring CP prefill)
    out = tmp_path / "bench.json"
    rc, text, state = slurm.sbatch(_script("bench.sbatch"), TWO_TASKS,
                                   ["prefill", "--cp", "2", "--cp-strategy", "ring", "--random-weights", "tiny",
                                    "--lengths", "64", "--repeats", "1", "--device", "cpu", "--dtype", "float32",
                                    "--out", str(out)], JOB_ENV)
    assert rc == 0, f"{state}\n{text}"
    bench = json.loads(out.read_text())
    assert (bench["cp"], bench["gpus"], [r["length"] for r in bench["results"]]) == (2, 2, [64])
    # eval.sbatch reaches launch/eval.py (its --help; a real eval needs a model)
    rc, text, state = slurm.sbatch(_script("eval.sbatch"), ["--nodes=1", "--ntasks-per-node=1", "--time=10"],
                                   ["--help"], JOB_ENV)
    assert rc == 0 and "usage: eval.py" in text and "launch/eval.py --help" in text, f"{state}\n{text}"
    # serve.sbatch reaches launch/serve.py the same way
    rc, text, state = slurm.sbatch(_script("serve.sbatch"), ["--nodes=1", "--ntasks-per-node=1", "--time=10"],
                                   ["--help"], JOB_ENV)
    assert rc == 0 and "usage: serve.py" in text and "launch/serve.py --help" in text, f"{state}\n{text}"


def test_sbatch_scripts_refuse_to_run_outside_slurm():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    for name in ("infer.sbatch", "bench.sbatch", "eval.sbatch", "serve.sbatch"):
        p = subprocess.run(["bash", _script(name), "--help"], capture_output=True, text=True, env=env, timeout=30)
        assert p.returncode == 2 and "run this with sbatch" in p.stderr, (name, p.stderr)
