"""Every gloo group meshspeed makes shares its process's transport device (one polling thread),
and groups on the shared device still carry concurrent collectives correctly."""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from meshspeed import comm
from meshspeed.comm import ParallelDims, gloo_transport
from meshspeed.comm.mesh import Mesh
from tests import harness

_labels = itertools.count()


def _loop_threads() -> int:
    """gloo's transport threads in this process (one per device torch or meshspeed made)."""
    n = 0
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                n += f.read().strip() == "gloo_tcp_loop"
        except OSError:
            pass  # the thread ended while we looked
    return n


def _new_groups_share_one_device(ctx, label: str):
    from torch.distributed import distributed_c10d as c10d

    before_threads, before_groups = _loop_threads(), len(c10d._world.pg_map)
    ws, r = ctx.world_size, ctx.rank
    odd = [[ws - 1]] if ws % 2 else []
    pairs = ctx.split([[i, i + 1] for i in range(0, ws - 1, 2)] + odd, f"{label}-pairs")
    whole = ctx.split([list(range(ws))], f"{label}-world")
    rev = ctx.split([list(reversed(range(ws)))], f"{label}-rev")
    # a Mesh made directly (not the context's cached one): its DeviceMesh makes new groups too
    Mesh(ParallelDims(dp=2, tp=ws // 2) if ws % 2 == 0 else ParallelDims(tp=ws), ctx)
    made = len(c10d._world.pg_map) - before_groups
    # concurrent collectives on three groups that share one device's sockets and thread
    xs = [torch.full((4096,), float(r + 1)) for _ in range(3)]
    hs = [comm.all_reduce(x, g, async_op=True) for x, g in zip(xs, (whole, rev, pairs))]
    got = [h.wait() for h in hs]
    return made, _loop_threads() - before_threads, [float(t[0]) for t in got], pairs.ranks


@pytest.mark.parametrize("ws", [2, 3, 4])
def test_groups_meshspeed_makes_add_no_transport_thread(ws):
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("needs Linux's /proc to count threads")
    out = harness.run(ws, _new_groups_share_one_device, f"gloo-{next(_labels)}")
    whole = ws * (ws + 1) / 2
    for r, (made, new_threads, sums, pair) in enumerate(out):
        assert made >= 3, f"rank {r}: the test made no new groups ({made})"
        assert new_threads == 0, f"rank {r}: {made} new groups started {new_threads} transport threads"
        assert sums[:2] == [whole, whole], (r, sums)
        assert sums[2] == sum(q + 1 for q in pair), (r, sums, pair)


def test_the_swap_is_scoped_and_other_backends_are_untouched():
    from torch.distributed import distributed_c10d as c10d

    base = c10d.ProcessGroupGloo
    with gloo_transport.shared("nccl"):
        assert c10d.ProcessGroupGloo is base
    with gloo_transport.shared("gloo"):
        inner = c10d.ProcessGroupGloo
        assert issubclass(inner, base) and inner is not base
        with gloo_transport.shared("gloo"):  # nested: the same class, restored only at the end
            assert c10d.ProcessGroupGloo is inner
        assert c10d.ProcessGroupGloo is inner
    assert c10d.ProcessGroupGloo is base
