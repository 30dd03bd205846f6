"""The GPU checks, one entry: `python -m pytest tests/gpu` on a CUDA machine (skipped without CUDA).
The CPU suite cannot reach the CUDA paths; these run the checks that can, each a script that also
runs on its own: launch/gpu_check.py (the attention dispatcher in every mask mode, the Triton lse
merges, and with two GPUs ring / Ulysses over NCCL, against float64), check_graph_decode.py (CUDA-graph
decode gives eager's tokens), check_moe_decode.py (the MoE decode expert kernels against float32),
check_prefill_syncs.py (where a prefill waits for the GPU) and `bench prefill --idle` (the GPU's idle time read
from the profiler's device trace).
The CUDA-only tests of the kernels (compiled kernels against their references) sit with their CPU
tests in tests/kernels and run in the same `python -m pytest` there."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from starshard.checkpoints.default import default_gguf

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="GPU checks need CUDA: run `python -m pytest tests/gpu` on a GPU machine")


def run(cmd: list[str], timeout: int = 1200) -> list[dict]:
    """Run a check script from the repo root; its JSON lines (rank 0's), after asserting it exited 0."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]


def test_attention_dispatcher_and_merges():
    rows = run([sys.executable, "launch/gpu_check.py"])
    assert rows and all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="ring / Ulysses over NCCL need two GPUs")
def test_context_parallel_attention_over_nccl():
    torchrun = shutil.which("torchrun") or pytest.skip("torchrun is not on PATH")
    rows = run([torchrun, "--nproc-per-node", "2", "launch/gpu_check.py", "--cp"])
    assert any(r["check"].startswith("cp/") for r in rows) and all(r["ok"] for r in rows)


def test_cuda_graph_decode_gives_eager_tokens():
    try:
        default_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    (res,) = run([sys.executable, str(HERE / "check_graph_decode.py"), "--prompt-len", "2000", "--steps", "16"])
    assert res["same_tokens"], res


def test_moe_decode_kernels_against_float32():
    rows = run([sys.executable, str(HERE / "check_moe_decode.py"), "--tokens", "1,8"])
    # bf16 weights and activations against the float32 reference
    assert rows and all(r["gemv_rel_err"] < 2e-2 and r["grouped_rel_err"] < 2e-2 for r in rows), rows


def test_prefill_reports_the_gpus_idle_time(tmp_path):
    """`bench prefill --idle` reads the device's own trace: some busy time, idle within the span, the gaps named."""
    out = tmp_path / "idle.json"
    run([sys.executable, "launch/bench.py", "prefill", "--random-weights", "tiny", "--cp-strategy", "dense",
         "--lengths", "1000", "--repeats", "1", "--decode-steps", "0", "--idle", "--out", str(out)])
    (row,) = json.loads(out.read_text())["results"]
    idle = row["device_idle"]
    assert 0 < idle["busy_s"] <= idle["span_s"] and idle["idle_s"] >= 0, idle
    assert abs(idle["busy_s"] + idle["idle_s"] - idle["span_s"]) < 1e-9 and len(idle["longest_gaps"]) <= 5, idle
    assert (idle["gaps"] > 0) == bool(idle["longest_gaps"]), idle


def test_prefill_makes_no_sync_but_the_tokens_read():
    """A whole prefill, dense, Star over 4 blocks and APB over 4 hosts on this device, reads nothing back from the
    GPU before its first token (runtime/generate.py): the positions' layout and end are known on the host
    (Segment.to, mark_arange), so neither the attention calls nor the cache's advance wait for the device."""
    waits_only_for_the_token(3, "--strategies", "dense,star:4,apb:4")


def waits_only_for_the_token(n: int, *flags: str) -> None:
    """check_prefill_syncs.py with these flags: n rows, each prefill's only sync the token's read."""
    rows = run([sys.executable, str(HERE / "check_prefill_syncs.py"), *flags])
    assert len(rows) == n, rows
    for r in rows:
        assert r["sync_sites"] and all(s.startswith("runtime/generate.py") for s in r["sync_sites"]), r


def test_sparse_prefill_makes_no_sync_but_the_tokens_read():
    """MInference (default pattern) and AnchorAttention with one theta per head (a calibrated file's form: each
    layer's thetas go to the GPU) forced sparse: the plans' host reads wait on events, never on a sync."""
    waits_only_for_the_token(2, "--strategies", "minference,anchor")


@pytest.mark.parametrize("model, flags", [("tiny-gemma3", []), ("tiny-moe", []), ("tiny", ["--prefill-chunk", "1024"]),
                                         ("tiny", ["--fp8", "linear,kv,attention"])])
def test_other_prefills_make_no_sync_but_the_tokens_read(model, flags):
    """Windowed and soft-capped layers (Gemma 3), routed experts (MoE), a prefill in chunks (the service's way,
    each chunk after held keys) and FP8 projections, cache and prefill scores: each waits only for its token."""
    waits_only_for_the_token(1, "--strategies", "dense", "--random-weights", model, *flags)


@pytest.mark.parametrize("copy", ["to_device", "upload"])
def test_small_host_copies_do_not_wait_for_the_gpu(copy):
    """The host's small inputs (a segment's positions, a decode step's tokens, a sparse plan's head lists) go to
    the GPU without waiting for its queue: while a long kernel still runs, the copy has returned (the event
    recorded after the kernel is not yet reached) and its values arrive in order after it."""
    from starshard.kernels.common import to_device, upload
    values = [[3, 1, 4], [1, 5, 9]]
    send = {"to_device": lambda: to_device(values, "cuda"), "upload": lambda: upload(torch.tensor(values), "cuda")}[copy]
    send()
    torch.cuda.synchronize()  # first-time allocations (the caching allocators' blocks) may wait; later copies not
    torch.cuda._sleep(4 * 10**9)  # ~2 s of GPU clock cycles
    busy = torch.cuda.Event()
    busy.record()
    out = send()
    waited = busy.query()
    torch.cuda.synchronize()
    assert not waited, f"{copy} waited for the GPU's queue before returning"
    assert out.tolist() == values
