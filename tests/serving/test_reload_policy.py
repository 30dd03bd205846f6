"""The disk reload policy alone (serving/reload_policy.py): optimistic until both rates are measured, the
estimates scale with bytes and FLOPs, the newest measurement weighs half, the margin, and "always"."""
from __future__ import annotations

import pytest

from starshard.serving.reload_policy import RATES_FILE, DiskReloadPolicy, Rate, reload_pays
from starshard.serving.tiers import TierConfig


def test_reload_pays_compares_with_a_margin():
    assert reload_pays(None, 1.0) and reload_pays(5.0, None) and reload_pays(None, None)
    assert reload_pays(1.0, 1.0) and not reload_pays(1.01, 1.0)
    assert reload_pays(1.4, 1.0, margin=1.5) and not reload_pays(1.6, 1.0, margin=1.5)


def test_rate_is_a_moving_average_per_unit():
    r = Rate()
    assert r.estimate(100) is None
    r.observe(2.0, 1000)  # the first sets it
    assert r.per_unit == pytest.approx(2e-3) and r.estimate(500) == pytest.approx(1.0)
    r.observe(4.0, 1000)  # then half each
    assert r.per_unit == pytest.approx(3e-3)
    r.observe(1.0, 0)  # nothing moved: no information
    r.observe(float("nan"), 10)
    assert r.per_unit == pytest.approx(3e-3) and r.estimate(None) is None


def test_policy_decides_from_both_rates():
    p = DiskReloadPolicy()
    assert p.decide(10**9, 1e12).promote  # nothing measured: try the reload
    p.observe_reload(10.0, 10**9)  # 10 ns a byte
    v = p.decide(10**9, 1e12)
    assert v.promote and v.reload_s == pytest.approx(10.0) and v.prefill_s is None  # no prefill measured yet
    p.observe_prefill(5.0, 1e12)  # 5 ps a FLOP
    v = p.decide(10**9, 1e12)
    assert not v.promote and v.reload_s == pytest.approx(10.0) and v.prefill_s == pytest.approx(5.0)
    assert p.decide(10**9, 2e12).promote  # a longer prefix: its prefill costs as much as the reload
    assert p.decide(4 * 10**8, 1e12).promote  # a smaller file
    assert p.decide(10**9, None).promote  # no FLOP model for this prompt
    wide = DiskReloadPolicy(margin=2.5)
    wide.observe_reload(10.0, 10**9)
    wide.observe_prefill(5.0, 1e12)
    assert wide.decide(10**9, 1e12).promote and not wide.decide(10**9, 0.7e12).promote
    always = DiskReloadPolicy("always")
    always.observe_reload(10.0, 10**9)
    always.observe_prefill(5.0, 1e12)
    v = always.decide(10**9, 1e12)
    assert v.promote and v.reload_s == pytest.approx(10.0) and v.prefill_s == pytest.approx(5.0)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="--disk-reload-policy"):
        DiskReloadPolicy("never")
    with pytest.raises(ValueError, match="margin"):
        DiskReloadPolicy(margin=0)
    with pytest.raises(ValueError, match="--disk-reload-policy"):
        TierConfig.from_gib(0, "/tmp/x", 1, disk_reload="sometimes")
    assert TierConfig.from_gib(0, "/tmp/x", 1, disk_reload="always").disk_reload == "always"


def test_rates_outlive_the_server_per_key_and_device(tmp_path, caplog):
    p = DiskReloadPolicy("split")
    p.save(tmp_path, "key/gpu")
    assert not (tmp_path / RATES_FILE).exists()  # nothing measured: nothing written
    p.observe_reload(2.0, 10**9)
    p.observe_prefill(3.0, 1e12)
    p.save(tmp_path, "key/gpu")
    other = DiskReloadPolicy()
    other.observe_reload(9.0, 10**9)
    other.save(tmp_path, "key/other-gpu")  # beside it, not over it
    again = DiskReloadPolicy("split")
    assert again.load(tmp_path, "key/gpu")
    assert again.reload.per_unit == pytest.approx(2e-9) and again.prefill.per_unit == pytest.approx(3e-12)
    elsewhere = DiskReloadPolicy()
    assert elsewhere.load(tmp_path, "key/other-gpu") and elsewhere.prefill.per_unit is None
    assert elsewhere.reload.per_unit == pytest.approx(9e-9)
    assert not DiskReloadPolicy().load(tmp_path, "another-key/gpu")
    (tmp_path / RATES_FILE).write_text("{not json")
    fresh = DiskReloadPolicy()
    assert not fresh.load(tmp_path, "key/gpu") and fresh.reload.per_unit is None  # damaged: measured again
    assert "ignoring" in caplog.text
    fresh.observe_reload(1.0, 10**9)
    fresh.save(tmp_path, "key/gpu")  # replaces the damaged file
    assert DiskReloadPolicy().load(tmp_path, "key/gpu")
