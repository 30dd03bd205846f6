"""`starshard cache list|purge`: what a disk tier holds, and removing it (refused under a running server)."""
import numpy as np
import pytest

from starshard.commands.main import main
from starshard.serving.disk_tier import DiskTier
from tests.helpers.kv_shards import key_for, make_kv


def fill(d):
    a, b = key_for(), key_for(cp=2, strategy="ring")
    for rank in (0, 1):
        with DiskTier(d, 1 << 30, a, rank) as t:
            t.put(1, np.arange(11), make_kv(length=11))
        with DiskTier(d, 1 << 30, b, rank) as t:
            t.put(1, np.arange(5), make_kv(length=5))
    (d / f"{'0' * 16}-{'1' * 16}-r0.kv").write_bytes(b"garbage")
    return a, b


def test_list_and_purge(tmp_path, capsys):
    a, b = fill(tmp_path)
    assert main(["cache", "list", "--disk-cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"key {a.short}" in out and f"key {b.short}" in out and "cp=2 ring" in out and "tp=1 cp=1 dense" in out
    assert out.count("read by any exact layout (one process, any tp, cp with ring / ulysses / usp)") == 2
    assert out.count("heads 0-1") == 4
    assert out.count("11 tokens") == 2 and out.count("5 tokens") == 2 and "damaged" in out and "rank 1" in out
    assert main(["cache", "purge", "--disk-cache-dir", str(tmp_path), "--key", b.short[:6]]) == 0
    assert "removed 2 file(s)" in capsys.readouterr().out
    assert sorted(p.name[:16] for p in tmp_path.glob("*.kv")) == sorted([a.short, a.short, "0" * 16])
    assert main(["cache", "list", "--disk-cache-dir", str(tmp_path), "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 3 and out.count('"read_by": "any exact layout') == 2
    assert main(["cache", "purge", "--disk-cache-dir", str(tmp_path), "--all"]) == 0
    assert list(tmp_path.glob("*.kv")) == []


def test_purge_is_refused_while_a_server_holds_the_rank(tmp_path, capsys):
    a, _ = fill(tmp_path)
    with DiskTier(tmp_path, 1 << 30, a, 1):
        assert main(["cache", "purge", "--disk-cache-dir", str(tmp_path), "--all"]) == 1
        assert "rank1.lock" in capsys.readouterr().err
    assert len(list(tmp_path.glob("*.kv"))) == 5  # nothing went


def test_list_says_which_layouts_read_an_entry(tmp_path, capsys):
    star = key_for(cp=2, strategy="star")
    with DiskTier(tmp_path, 1 << 30, star, 0) as t:
        t.put(1, np.arange(5), make_kv(length=5))
    assert main(["cache", "list", "--disk-cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "tp=1 cp=2 star" in out and "read by this layout only (star's KV is not dense attention's)" in out


@pytest.mark.parametrize("argv,err", [(["purge"], "one of the arguments --all --key is required"),
                                      (["purge", "--key", "XYZ"], "4 to 16 lowercase hex"),
                                      (["list"], "not a directory")])
def test_bad_flags_are_named(tmp_path, capsys, argv, err):
    args = ["cache", *argv, "--disk-cache-dir", str(tmp_path / ("missing" if argv == ["list"] else ""))]
    try:
        code = main(args)
    except SystemExit as e:
        code = e.code
    assert code == 2 and err in capsys.readouterr().err


@pytest.mark.parametrize("sub", ["list", "purge"])
def test_help_explains_every_flag(sub, capsys):
    with pytest.raises(SystemExit) as e:
        main(["cache", sub, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith(f"usage: starshard cache {sub}") and "--disk-cache-dir" in out
    if sub == "purge":
        assert "--all" in out and "--key HEX" in out
