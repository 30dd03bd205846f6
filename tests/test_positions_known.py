"""Positions the host already knows (common.mark_arange): the model marks the runs it makes with
torch.arange, and the layout questions asked per attention call (query_offset, mask_mode) are answered
from the mark instead of a device read (a host sync per call on a GPU). The answers must equal the
read ones on every layout; a marked tensor on the meta device (nothing to read) proves no read."""
import pytest
import torch

from starshard.kernels.attention import mask_mode
from starshard.kernels.common import arange_start, mark_arange, query_offset

CASES = [  # (q start, Lq, k start, Lk)
    (0, 40, 0, 40),     # square prefill
    (25, 15, 0, 40),    # tail block after its keys
    (40, 8, 0, 40),     # every key before every query
    (3, 10, 7, 30),     # query block starting before the first key
    (5, 20, 5, 20),
    (0, 20, 3, 20),
]


def marked(start, n):
    return mark_arange(torch.arange(start, start + n), start)


@pytest.mark.parametrize("case", CASES)
def test_marked_runs_answer_as_read(case):
    qs, lq, ks, lk = case
    qm, km = marked(qs, lq), marked(ks, lk)
    qr, kr = torch.arange(qs, qs + lq), torch.arange(ks, ks + lk)  # unmarked: read
    assert arange_start(qm) == qs and arange_start(qr) is None
    for causal in (True, False):
        assert mask_mode(qm, km, causal) == mask_mode(qr, kr, causal)
    try:
        want = query_offset(qr, kr, lq, lk)
    except ValueError as e:
        with pytest.raises(ValueError, match="start at or after the first key"):
            query_offset(qm, km, lq, lk)
        assert "start at or after the first key" in str(e)
    else:
        assert query_offset(qm, km, lq, lk) == want
    # one side marked: read as before
    assert mask_mode(qm, kr, True) == mask_mode(qr, kr, True)


def test_marked_answers_without_reading():
    q = mark_arange(torch.empty(16, dtype=torch.long, device="meta"), 100)
    k = mark_arange(torch.empty(116, dtype=torch.long, device="meta"), 0)
    assert query_offset(q, k, 16, 116) == 100
    assert mask_mode(q, k, True) == "masked" and mask_mode(k, k, True) == "causal"


def test_mark_goes_with_the_tensor():
    t = marked(7, 5)
    key = id(t)
    del t
    u = torch.arange(5)
    assert arange_start(u) is None or id(u) != key
    with pytest.raises(ValueError, match="1-D"):
        mark_arange(torch.arange(6).view(2, 3), 0)
