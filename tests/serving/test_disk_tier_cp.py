"""A cp=2 restart on one shared directory: every rank reloads its own shard, and when one rank's file is
missing or damaged every rank answers None (re-prefill), none hangs."""
import numpy as np
import torch.distributed as dist

from starshard.serving.disk_tier import DiskTier, file_name, load_everywhere
from starshard.serving.kv_file import read_header
from tests.helpers.kv_shards import assert_kv_equal, key_for, make_kv
from tests.helpers.mp_harness import run_ranks

DOC = np.arange(500, 523)


def ranks(rank, world, directory):
    key = key_for(cp=2, strategy="ring", query_rank=1)
    shard = make_kv(length=12 - rank, seed=rank, fp8=rank == 1)  # the ranks' shards differ in rows and format
    with DiskTier(directory, 1 << 30, key, rank) as t:
        t.put(1, DOC, shard)
    dist.barrier()
    out = []
    with DiskTier(directory, 1 << 30, key, rank) as t:  # the restart
        found, n = t.get(np.r_[DOC, 7]) if rank == 0 else (None, 0)
        ids = [found.ids if found is not None else None]
        dist.broadcast_object_list(ids, src=0)  # the scheduler's op carries rank 0's choice
        kv = load_everywhere(t, ids[0], "cpu")
        assert_kv_equal(shard, kv)
        out.append(n)
        if rank == 1:
            t.remove(file_name(key, DOC, 1))  # rank 1 lost its file
        dist.barrier()
        out.append(load_everywhere(t, ids[0], "cpu") is None)
    dist.barrier()
    with DiskTier(directory, 1 << 30, key, rank) as t:
        if rank == 1:
            t.put(1, DOC, shard)
        else:  # rank 0's file damaged in its payload: found at load, removed
            p = t.entry_for(DOC).path
            h = read_header(p)
            raw = bytearray(p.read_bytes())
            raw[h.payload_offset + h.sections[1].offset] ^= 4
            p.write_bytes(bytes(raw))
        dist.barrier()
        out.append(load_everywhere(t, DOC, "cpu") is None)
        out.append(t.entry_for(DOC) is None)
    return out


def test_cp2_restart_reloads_every_shard_or_none(tmp_path):
    r0, r1 = run_ranks(ranks, 2, str(tmp_path))
    assert r0 == [23, True, True, True] and r1 == [0, True, True, False]
