"""Masks under tensor parallelism: global mask, sliced; straddling M-groups rejected."""

import pytest
import torch

from meshspeed.comm.placement import Shard, assemble, local_piece
from meshspeed.sparse import check_shardable, is_nm, is_transposable_nm, nm_mask, transposable_2to4_mask


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dim", [0, -1])
def test_shards_are_slices_of_the_global_mask(world, dim):
    torch.manual_seed(world)
    w = torch.randn(4 * world * 2, 8 * world)  # every split below keeps whole 4-groups
    full = transposable_2to4_mask(w)
    check_shardable("mlp.up", full.shape, dim, world, (2, 4), transposable=True)
    shards = [local_piece(full, Shard(dim), r, world) for r in range(world)]  # masks split like weights
    assert torch.equal(assemble(shards, Shard(dim)), full)
    for r, s in enumerate(shards):
        assert torch.equal(s, torch.chunk(full, world, dim=dim)[r])
        assert is_transposable_nm(s)  # each rank's piece is a valid 2:4 matrix on its own


def test_straddle_validation_names_layer_and_sizes():
    with pytest.raises(ValueError) as info:
        check_shardable("layers.3.mlp.down", (64, 24), -1, 4, (2, 4))
    msg = str(info.value)
    for needle in ("layers.3.mlp.down", "in_features 24", "tp degree 4", "M=4"):
        assert needle in msg
    with pytest.raises(ValueError, match="in_features 20 over tp degree 2"):
        check_shardable("layers.0.attn.o", (64, 20), -1, 2, (2, 4))
    # 24 / 2 = 12 and 24 / 3 = 8 columns per rank, multiples of 4: fine
    check_shardable("layers.3.mlp.down", (64, 24), -1, 2, (2, 4))
    check_shardable("layers.3.mlp.down", (64, 24), -1, 3, (2, 4))
    # 4:8 with 24 columns over 2 ranks: 12 per rank straddles an 8-group
    with pytest.raises(ValueError, match="M=8"):
        check_shardable("x", (8, 24), -1, 2, (4, 8))
    with pytest.raises(ValueError, match="does not split evenly"):
        check_shardable("x", (8, 24), -1, 5, (2, 4))
    with pytest.raises(ValueError, match="out_features 24"):
        check_shardable("x", (24, 16), 0, 4, (2, 4), transposable=True)
    check_shardable("x", (24, 16), 0, 4, (2, 4))  # row-only N:M does not care about the out dim
    check_shardable("x", (24, 18), -1, 3, None)  # unstructured: only even splitting matters


def test_straddling_shard_would_break_the_pattern():
    """Why the check exists: slicing inside a group leaves shards that are not N:M."""
    full = nm_mask(torch.randn(4, 8), 2, 4)
    left = local_piece(full, Shard(-1), 0, 4)  # 2 columns per rank
    assert not is_nm(left, 2, 4)
    with pytest.raises(ValueError, match="straddle"):
        check_shardable("x", full.shape, -1, 4, (2, 4))
