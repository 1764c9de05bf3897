"""DualPipeV's task lists against DeepSeek's reference step order (golden lists).

The golden lists were written by hand from the eight phases of the published reference
(`dualpipev.py` in deepseek-ai/DualPipe, `DualPipeV.step`), rank by rank: nF0 = 2(p-1-r);
nF0F1 = r+1 (F0 then F1); nB1W1F1 = p-1-r (B1 zero-bubble, W, F1); the main phase
m-2p+r+1 times (F0 & B1, F1 & B0; on the last rank the first F0/B1 pair is not overlapped);
nB1F1B0 = p-1-r; nB1B0 = r+1, zero-bubble from half-way (odd ranks before B1, even ranks
between B1 and B0); nWB0 = p-1-r (W, B0 zero-bubble); nW = r+1. A zero-bubble backward is
`bwdI` with its `bwdW` queued (first in, first out) for the next W; any other backward is `bwdI`
then `bwdW`. Rank r holds stages r (chunk 0) and 2p-1-r (chunk 1).
"""

from __future__ import annotations

import pytest

import jaxpp_integration as jaxpp

GOLDEN = {
    (2, 4): [
        "fwd_0__0 fwd_0__1 fwd_0__2 fwd_3__0 bwdI_3__0 bwdW_3__0 fwd_3__1 fwd_0__3 bwdI_3__1 "
        "bwdW_3__1 fwd_3__2 bwdI_0__0 bwdW_0__0 bwdI_3__2 bwdW_3__2 fwd_3__3 bwdI_0__1 "
        "bwdW_0__1 bwdI_3__3 bwdW_3__3 bwdI_0__2 bwdW_0__2 bwdI_0__3 bwdW_0__3",
        "fwd_1__0 fwd_2__0 fwd_1__1 fwd_2__1 fwd_1__2 bwdI_2__0 bwdW_2__0 fwd_2__2 bwdI_1__0 "
        "bwdW_1__0 fwd_1__3 bwdI_2__1 bwdW_2__1 fwd_2__3 bwdI_1__1 bwdW_1__1 bwdI_2__2 "
        "bwdW_2__2 bwdI_1__2 bwdW_1__2 bwdI_2__3 bwdI_1__3 bwdW_2__3 bwdW_1__3",
    ],
    (3, 6): [
        "fwd_0__0 fwd_0__1 fwd_0__2 fwd_0__3 fwd_0__4 fwd_5__0 bwdI_5__0 bwdW_5__0 fwd_5__1 "
        "bwdI_5__1 bwdW_5__1 fwd_5__2 fwd_0__5 bwdI_5__2 bwdW_5__2 fwd_5__3 bwdI_0__0 "
        "bwdW_0__0 bwdI_5__3 bwdW_5__3 fwd_5__4 bwdI_0__1 bwdW_0__1 bwdI_5__4 bwdW_5__4 "
        "fwd_5__5 bwdI_0__2 bwdW_0__2 bwdI_5__5 bwdW_5__5 bwdI_0__3 bwdW_0__3 bwdI_0__4 "
        "bwdW_0__4 bwdI_0__5 bwdW_0__5",
        "fwd_1__0 fwd_1__1 fwd_1__2 fwd_4__0 fwd_1__3 fwd_4__1 bwdI_4__0 bwdW_4__0 fwd_4__2 "
        "fwd_1__4 bwdI_4__1 bwdW_4__1 fwd_4__3 bwdI_1__0 bwdW_1__0 fwd_1__5 bwdI_4__2 "
        "bwdW_4__2 fwd_4__4 bwdI_1__1 bwdW_1__1 bwdI_4__3 bwdW_4__3 fwd_4__5 bwdI_1__2 "
        "bwdW_1__2 bwdI_4__4 bwdW_4__4 bwdI_1__3 bwdW_1__3 bwdI_4__5 bwdI_1__4 bwdW_4__5 "
        "bwdI_1__5 bwdW_1__4 bwdW_1__5",
        "fwd_2__0 fwd_3__0 fwd_2__1 fwd_3__1 fwd_2__2 fwd_3__2 fwd_2__3 bwdI_3__0 bwdW_3__0 "
        "fwd_3__3 bwdI_2__0 bwdW_2__0 fwd_2__4 bwdI_3__1 bwdW_3__1 fwd_3__4 bwdI_2__1 "
        "bwdW_2__1 fwd_2__5 bwdI_3__2 bwdW_3__2 fwd_3__5 bwdI_2__2 bwdW_2__2 bwdI_3__3 "
        "bwdW_3__3 bwdI_2__3 bwdW_2__3 bwdI_3__4 bwdW_3__4 bwdI_2__4 bwdI_3__5 bwdI_2__5 "
        "bwdW_2__4 bwdW_3__5 bwdW_2__5",
    ],
}


@pytest.mark.parametrize("p, m", sorted(GOLDEN))
def test_dualpipev_follows_the_reference_step_order(p, m):
    got = [" ".join(map(str, row)) for row in jaxpp.DualPipeV(p).tasks(m)]
    for rank, (want, have) in enumerate(zip(GOLDEN[(p, m)], got, strict=True)):
        assert have == want, f"rank {rank}"


def test_fused_pairs_are_the_reference_overlapped_pairs():
    """fuse_overlap=True: the main phase's F & B pairs as one item each, except the last rank's
    first F0/B1 pair, which the reference does not overlap either."""
    last = jaxpp.DualPipeV(2, fuse_overlap=True).tasks(4)[1]
    assert " ".join(map(str, last)) == (
        "fwd_1__0 fwd_2__0 fwd_1__1 fwd_2__1 fwd_1__2 bwdI_2__0 bwdW_2__0 "
        "FusedTask(fwd_2__2, bwdI_1__0, bwdW_1__0) FusedTask(fwd_1__3, bwdI_2__1, bwdW_2__1) "
        "FusedTask(fwd_2__3, bwdI_1__1, bwdW_1__1) bwdI_2__2 bwdW_2__2 bwdI_1__2 bwdW_1__2 "
        "bwdI_2__3 bwdI_1__3 bwdW_2__3 bwdW_1__3"
    )
