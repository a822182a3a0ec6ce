"""The one placement vocabulary: pieces follow torch.chunk, assemble inverts local_piece, and
the collective gathers rebuild full tensors over one or two split axes at 2, 3 and 4 ranks."""

from __future__ import annotations

import pytest
import torch

from meshspeed import comm
from meshspeed.comm.placement import (
    Partial,
    Replicate,
    Shard,
    Sharding,
    assemble,
    chunk_bounds,
    full_tensor,
    local_piece,
    shard_tensor,
    sharding_of,
)
from tests import harness


@pytest.mark.parametrize("n", [1, 5, 10, 11, 256])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_chunk_bounds_follow_torch_chunk(n, parts):
    offs = chunk_bounds(n, parts)
    pieces = torch.arange(n).chunk(parts)
    want = [c.numel() for c in pieces] + [0] * (parts - len(pieces))
    assert [offs[i + 1] - offs[i] for i in range(parts)] == want and offs[-1] == n


@pytest.mark.parametrize("placement", [Shard(0), Shard(1), Shard(-1), Partial(), Replicate()])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_assemble_inverts_local_piece(placement, size):
    full = torch.randn(7, 10, generator=torch.Generator().manual_seed(size))
    pieces = [local_piece(full, placement, r, size) for r in range(size)]
    assert torch.equal(assemble(pieces, placement), full)
    if isinstance(placement, Shard):
        for r, p in enumerate(pieces):
            assert torch.equal(p, full.chunk(size, placement.dim)[r])


def test_sharding_local_shape_and_meta():
    s = Sharding(torch.Size([6, 10, 4]), (("ep", Shard(0)), ("tp", Shard(1))))
    assert s.local_shape({"ep": 1, "tp": 2}, {"ep": 3, "tp": 3}) == torch.Size([2, 2, 4])
    assert s.shard_dims() == {"ep": 0, "tp": 1} and s.placement("dp") == Replicate()

    class G:
        size, rank = 3, 2

    meta = torch.empty(10, 4, device="meta")
    piece = shard_tensor(meta, "tp", Shard(0), G())  # a meta model is split before it has memory
    assert piece.is_meta and piece.shape == (2, 4) and sharding_of(piece).full_shape == (10, 4)
    with pytest.raises(comm.ConfigError, match=r"parallel.tp=3 leaves an empty piece"):
        shard_tensor(torch.empty(2, 4, device="meta"), "tp", Shard(0), G())


def job_full_tensor(ctx):
    """Split a [6, 9] tensor over (a, Shard(0)) then (b, Shard(1)) on a 2-D layout of the world and
    gather it back; also a Partial sum."""
    ws, r = ctx.world_size, ctx.rank
    full = torch.arange(54, dtype=torch.float32).reshape(6, 9)
    mesh = comm.ParallelDims(dp=ws // 2 if ws % 2 == 0 else 1, tp=2 if ws % 2 == 0 else ws).build(ctx)
    groups = {"a": mesh["dp"], "b": mesh["tp"]}
    x = shard_tensor(full, "a", Shard(0), groups["a"])
    x = shard_tensor(x, "b", Shard(1), groups["b"])
    bad = []
    if not torch.equal(full_tensor(x, groups), full):
        bad.append("two-axis gather")
    part = local_piece(full, Partial(), r, ws)
    if not torch.equal(full_tensor(part, {"w": ctx.world}, Sharding(full.shape, (("w", Partial()),))), full):
        bad.append("partial sum")
    return bad


@pytest.mark.parametrize("ws", [2, 3, 4])
def test_full_tensor_gathers_every_axis(ws):
    assert harness.run(ws, job_full_tensor) == [[]] * ws
