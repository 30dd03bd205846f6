"""The `starshard` program (starshard/commands/main.py): one command per job, each with its own flags."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from starshard.commands import infer
from starshard.commands.main import COMMANDS, main

ROOT = Path(__file__).resolve().parents[2]
SIX = ("run", "serve", "eval", "bench", "convert", "plan")
TINY = ["--random-weights", "tiny", "--prompt-len", "24", "--max-new-tokens", "5", "--device", "cpu", "--json"]


def sh(*argv):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def test_python_m_starshard_lists_the_commands():
    p = sh("-m", "starshard", "--help")
    assert p.returncode == 0, p.stderr
    for name in SIX:
        assert f"\n  {name} " in p.stdout, p.stdout


def test_help_and_version_load_no_command():
    """`starshard --help` / `--version` import no command module: no torch, no kernels (fast on 2 cores)."""
    code = ("import sys; from starshard.commands.main import main; main(['--help']); main(['--version']); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('starshard.kernels', "
            "'starshard.commands.', 'starshard.server'))))")
    p = sh("-c", code)
    assert p.returncode == 0, p.stderr
    *help_lines, version, loaded = p.stdout.strip().splitlines()
    assert loaded == "['starshard.commands.main']", loaded
    assert version.startswith("starshard ") and version.split()[1][0].isdigit(), version
    assert all(f"\n  {name} " in "\n".join(help_lines) for name in COMMANDS)


def test_ctrl_c_while_a_command_loads_exits_130_without_a_traceback(tmp_path):
    """Ctrl-C before a command takes over its signals (importing torch, loading a model) ends the process quietly."""
    (tmp_path / "interrupted_command.py").write_text("def main(argv):\n    raise KeyboardInterrupt\n")
    code = ("import sys; from starshard.commands import main as m; "
            "m.COMMANDS['x'] = m.Command('interrupted_command', 'raises KeyboardInterrupt'); "
            f"sys.path.insert(0, {str(tmp_path)!r}); sys.argv = ['starshard', 'x']; m.main()")
    p = sh("-c", code)
    assert p.returncode == 130, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr and "interrupted" in p.stderr, p.stderr


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_command_shows_its_full_help(name, capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))  # bench sets a default
    with pytest.raises(SystemExit) as e:
        main([name, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ") and "options:" in out
    assert out.startswith(f"usage: starshard {name} ")
    flat = " ".join(out.split())
    assert "(default: None)" not in flat and not re.search(r"\(default: [^()]*\) \(default: ", flat)
    flags = {"run": "--plan-only", "plan": "--memory-limit-gb", "serve": "--port", "eval": "--lengths",
             "bench": "prefill", "convert": "--hf"}
    assert flags.get(name, "-h") in out


def test_unknown_command_names_the_commands(capsys):
    assert main(["infer"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'infer'" in err and "run, plan, serve" in err
    assert main([]) == 2 and "usage: starshard <command>" in capsys.readouterr().err


def test_plan_prints_the_plan_as_run_plan_only_does(capsys):
    argv = ["--random-weights", "tiny", "--prompt-len", "300", "--max-new-tokens", "8", "--json"]
    assert main(["plan", *argv]) == 0
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert infer.main([*argv, "--plan-only"]) == 0
    assert plan == json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plan["stages"] and plan["fits"]
    assert main(["plan", *argv[:-1]]) == 0
    assert "peak" in capsys.readouterr().out  # the table


def test_plan_reads_the_study_modes_block_count(capsys):
    """--num-blocks / --apb-hosts on one device: the plan's largest forward is one block's, not the context's."""
    argv = ["--random-weights", "tiny", "--prompt-len", "400", "--json"]

    def rows(*extra):
        assert main(["plan", *argv, *extra]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["stages"][0]["rows"]

    star_one, apb_one = rows("--cp-strategy", "star"), rows("--cp-strategy", "apb")
    # blocks of 100, the anchor read from the cache; with --sparse each block runs behind its 100-token anchor
    assert rows("--cp-strategy", "star", "--num-blocks", "4") == 100 < star_one == 399
    assert rows("--cp-strategy", "star", "--num-blocks", "4", "--sparse", "minference") == 200
    assert rows("--cp-strategy", "apb", "--apb-hosts", "4") < apb_one / 2


@pytest.mark.slow  # two processes load torch and run a tiny model: ~10 s on 2 cores
def test_run_gives_the_same_answer_as_launch_infer():
    a, b = sh("-m", "starshard", "run", *TINY), sh("launch/infer.py", *TINY)
    assert a.returncode == 0 and b.returncode == 0, a.stderr[-2000:] + b.stderr[-2000:]
    ja, jb = (json.loads(p.stdout.strip().splitlines()[-1]) for p in (a, b))
    timing = ("prefill_seconds", "decode_seconds", "decode_tokens_per_second")
    assert {k: v for k, v in ja.items() if k not in timing} == {k: v for k, v in jb.items() if k not in timing}
    assert len(ja["token_ids"]) == 5


@pytest.mark.parametrize("flag,value,why", [
    ("--temperature", "-1", "must be >= 0"), ("--top-p", "0", "must be > 0"), ("--top-p", "1.5", "must be <= 1"),
    ("--top-k", "-2", "must be >= 0"), ("--max-new-tokens", "-1", "must be >= 0"), ("--tp", "0", "must be >= 1"),
    ("--prompt-len", "0", "must be >= 1"), ("--memory-limit-gb", "0", "must be > 0"),
    ("--temperature", "nan", "must be a finite number"), ("--top-k", "1.5", "'1.5' is not an integer"),
])
def test_numeric_flags_are_checked_by_the_parser(flag, value, why, capsys):
    """An out-of-range value is argparse's one-line error naming the flag (exit 2), no traceback."""
    with pytest.raises(SystemExit) as e:
        main(["run", "--prompt", "hi", flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"starshard run: error: argument {flag}: {why}" in err and "Traceback" not in err, err


def test_a_run_config_value_is_checked_as_its_flag(tmp_path, capsys):
    cfg = tmp_path / "run.toml"
    cfg.write_text("top-p = 0.0\n")
    with pytest.raises(SystemExit) as e:
        main(["run", "--config", str(cfg)])
    assert e.value.code == 2 and "top-p = 0.0: not a valid value for --top-p (must be > 0" in capsys.readouterr().err
    cfg.write_text("temperature = 1\ntop-p = 0.5\nmemory-limit-gb = 2\n")
    args = infer.parse_args(["--config", str(cfg)])
    assert (args.temperature, args.top_p, args.memory_limit_gb) == (1.0, 0.5, 2.0)


PLAN_1M = ["--random-weights", "llama-3.1-8b", "--tp", "2", "--cp", "4", "--prompt-len", "1048000", "--dtype",
           "bfloat16", "--device", "cuda"]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="planning a GPU job from a machine without CUDA")
def test_plan_for_cuda_without_cuda(capsys):
    """Without CUDA the GPU's memory cannot be read: one line naming --memory-limit-gb (exit 2); with it the
    plan runs (the 1M prompt too, past the model's real 128K context: a warning); DOES NOT FIT exits 1."""
    assert main(["plan", *PLAN_1M]) == 2
    err = capsys.readouterr().err
    assert "error: --device cuda without a CUDA device here: give --memory-limit-gb" in err and "Traceback" not in err
    assert main(["plan", *PLAN_1M, "--memory-limit-gb", "80"]) == 0
    out, err = capsys.readouterr()
    assert "limit 80.000 GiB: fits" in out and "past llama-3.1-8b's real context of 131072 tokens" in err
    assert main(["plan", *PLAN_1M, "--memory-limit-gb", "20"]) == 1
    out, err = capsys.readouterr()
    assert "DOES NOT FIT" in out and "smallest layout that fits" in err
    assert main(["plan", *PLAN_1M[:7], "131072", *PLAN_1M[8:], "--max-new-tokens", "0", "--memory-limit-gb", "80"]) == 0
    assert "real context" not in capsys.readouterr().err  # within it: no warning


def test_other_libraries_log_lines_keep_their_own_prefix():
    """run and serve log through cli.log_handler: starshard's lines read [starshard], megatron-core's import
    notices [megatron] (not [starshard])."""
    import logging

    from starshard.cli import log_handler

    h = log_handler()

    def line(name):
        return h.format(logging.LogRecord(name, logging.INFO, __file__, 1, "hello %s", ("x",), None))

    assert line("starshard.server") == "[starshard] hello x"
    assert line("megatron.core.distributed.fsdp.src.megatron_fsdp") == "[megatron] hello x"
