"""host_tier: device <-> host copies bit-exact (the CPU path of the same code), the LRU within a budget."""
import numpy as np
import pytest
import torch

from starshard.serving.host_tier import DeviceLoader, HostTier, layout, to_device, to_host
from tests.helpers.kv_shards import assert_kv_equal, make_kv


@pytest.mark.parametrize("dtype,fp8", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_host_round_trip_is_bit_exact(dtype, fp8):
    kv = make_kv(length=9, heads=2, batch=2, dtype=dtype, fp8=fp8, capacity=32)
    host = to_host(kv)
    assert host.done() and host.length == 9 and host.fp8 == fp8
    _, nbytes = layout([0, 1, 2], 2, 2, 8, 9, dtype, fp8)
    assert host.nbytes == nbytes  # the filled rows, not the capacity of 32
    load = to_device(host, "cpu", extra_capacity=3)
    assert load.events == {} and load.done()
    load.wait(0)  # nothing to wait for on the CPU
    assert_kv_equal(kv, load.kv)
    assert load.kv.layers[1].capacity == 12
    # the host copy is a copy: changing the source leaves it alone
    kv.layers[0].k.zero_()
    assert not torch.equal(host.layer(0).k.float(), kv.layers[0].stored().k.float())


def entry(n, seed=0):
    kv = make_kv(length=n, seed=seed)
    return to_host(kv)


def test_lru_within_the_budget():
    a, b, c = entry(10, 1), entry(10, 2), entry(10, 3)
    tier = HostTier(budget_bytes=2 * a.nbytes + 100)
    assert tier.put(1, np.arange(10), a) == []
    assert tier.put(2, np.arange(10) + 50, b) == []
    found, n = tier.lookup(np.r_[np.arange(10), 7, 8])  # a follow-up on entry 1: touched
    assert found.id == 1 and n == 10
    victims = tier.put(3, np.arange(10) + 90, c)
    assert [v.id for v in victims] == [2]  # the least recently used goes, handed back for the disk tier
    assert sorted(tier.entries) == [1, 3]
    s = tier.stats
    assert (s.entries, s.bytes, s.demotions, s.evictions, s.hits, s.lookups) == (2, 2 * a.nbytes, 3, 1, 1, 1)
    with pytest.raises(ValueError, match="--host-cache-gib"):
        tier.put(4, np.arange(40), entry(40))
    assert sorted(tier.entries) == [1, 3]


def test_lookup_leaves_a_token_to_run_and_needs_min_tokens():
    tier = HostTier(1 << 30)
    tier.put(1, np.arange(10), entry(10))
    assert tier.lookup(np.arange(10))[1] == 9
    assert tier.lookup(np.r_[0, 1, 99], min_tokens=3) == (None, 0)
    assert tier.lookup(np.r_[5, 6]) == (None, 0)


def test_every_rank_evicts_the_same_with_rank_bytes():
    """Rank 0 plans with every CP rank's bytes: rank 1's larger shard decides, as on rank 1 itself."""
    tier = HostTier(budget_bytes=1000, ranks=2)
    tier.put(1, [1, 2], entry(4), rank_bytes=[100, 600])
    tier.put(2, [3, 4], entry(4), rank_bytes=[100, 300])
    assert tier.plan_room([10, 200]) == [1]
    victims = tier.put(3, [5, 6], entry(4), rank_bytes=[100, 300])
    assert [v.id for v in victims] == [1] and tier.used(1) == 600


def test_load_promotes_and_counts():
    kv = make_kv(length=7, fp8=True)
    tier = HostTier(1 << 30)
    tier.put(5, np.arange(7), to_host(kv))
    load = tier.load(5, "cpu", extra_capacity=2)
    assert_kv_equal(kv, load.kv)
    assert 5 in tier.entries  # keep=True: the host copy stays (a later demotion costs nothing)
    tier.load(5, "cpu", keep=False)
    assert tier.entries == {}
    s = tier.stats.as_dict()
    assert s["promotions"] == 2 and s["reload_seconds_count"] == 2 and s["reload_seconds_buckets"]["+Inf"] == 2


def test_the_stepwise_loader_refuses_to_finish_early():
    host = to_host(make_kv(length=5))
    loader = DeviceLoader(host, "cpu")
    loader.copy_layer(0)
    with pytest.raises(RuntimeError, match=r"layers \[1, 2\] were never copied"):
        loader.finish()
