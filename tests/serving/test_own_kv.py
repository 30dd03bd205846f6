"""The batch's own-KV pool (cascade.OwnKV): rows move between pools when requests join or leave the batch. A
gather keeps each row's filled slots exactly, reads the slots past a row's length as empty, and costs a few
copies per row whatever the number of layers (one per layer and row left the device idle for the host's
~1,500 launches per change at 32 layers x 16 rows)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from starshard.serving.cascade import _NO_KEY, OwnKV

H, D = 2, 4


def _pool(layers, lengths: list[int], capacity: int, seed: int) -> OwnKV:
    g = torch.Generator().manual_seed(seed)
    pool = OwnKV(layers, len(lengths), H, D, capacity, torch.float32, "cpu")
    for b, n in enumerate(lengths):
        for i in layers:
            pool.k[i][b, :, :n] = torch.randn(H, n, D, generator=g)
            pool.v[i][b, :, :n] = torch.randn(H, n, D, generator=g)
            pool.pos[i][b, :n] = torch.arange(100 + 10 * b, 100 + 10 * b + n)
        pool.lengths[b] = n
        pool._lengths[b] = n
    return pool


def test_gather_keeps_rows_and_empties_the_rest():
    layers = [0, 2, 5]
    a, b = _pool(layers, [3, 0, 6], 8, 1), _pool(layers, [5, 2], 7, 2)
    parts = [(b, 1), (a, 2), (a, 1), (b, 0), (a, 0)]
    out = OwnKV.gather(parts, 2, layers, H, D, torch.float32, "cpu")
    assert out.lengths == [2, 6, 0, 5, 3] and out._lengths.tolist() == out.lengths
    assert out.capacity == 6 + 2 and out.batch == 5
    for j, (p, r) in enumerate(parts):
        n = p.lengths[r]
        for i in layers:
            assert torch.equal(out.k[i][j, :, :n], p.k[i][r, :, :n])
            assert torch.equal(out.v[i][j, :, :n], p.v[i][r, :, :n])
            assert torch.equal(out.pos[i][j, :n], p.pos[i][r, :n])
            assert (out.pos[i][j, n:] == _NO_KEY).all()  # empty: after every query, so causality hides it
    out.append(2, torch.ones(5, H, 1, D), torch.ones(5, H, 1, D), torch.full((5, 1), 7))
    assert out.pos[2][1, 6] == 7 and out.pos[2][2, 0] == 7  # appends go after each row's filled slots


def test_gather_refuses_another_models_pool():
    with pytest.raises(ValueError, match="layers"):
        OwnKV.gather([(_pool([0, 1], [2], 4, 0), 0)], 1, [0, 1, 2], H, D, torch.float32, "cpu")


class _Copies(TorchDispatchMode):
    """Counts the operations that move data (not the views)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name.split("::")[1].rstrip("_") in ("copy", "index_put", "index", "where", "fill"):
            self.n += 1
        return func(*args, **(kwargs or {}))


def _copies(layers: int, rows: int) -> int:
    ids = list(range(layers))
    pool = _pool(ids, [3] * rows, 6, 0)
    with _Copies() as c:
        OwnKV.gather([(pool, r) for r in range(rows)], 1, ids, H, D, torch.float32, "cpu")
    return c.n


def test_gather_copies_do_not_grow_with_layers():
    assert _copies(32, 16) == _copies(2, 16) <= 3 * 16 + 1, "a copy per layer: the host's launches grow with depth"
