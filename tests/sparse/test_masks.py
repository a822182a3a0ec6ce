"""Mask construction: validity for every pattern, exact counts, optimality, ERK budget, flip rate."""

import itertools

import pytest
import torch

from meshspeed.sparse import (
    density,
    erk_sparsities,
    flip_count,
    flip_rate,
    is_nm,
    is_transposable_nm,
    keep_count,
    nm_mask,
    topk_mask,
    transposable_2to4_mask,
    transposable_patterns,
)

SHAPES = [(8, 16), (12, 24), (5, 40), (3, 7, 16)]  # includes a stacked [E, out, in]


def _random_shapes(seed, n=3, m=8):
    g = torch.Generator().manual_seed(seed)
    return [
        (int(torch.randint(1, 20, (1,), generator=g)), m * int(torch.randint(1, 9, (1,), generator=g)))
        for _ in range(n)
    ]


@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (4, 8), (3, 8)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nm_mask_valid_and_keeps_largest(n, m, seed):
    torch.manual_seed(seed)
    for shape in _random_shapes(seed, m=m) + [s for s in SHAPES if s[-1] % m == 0]:
        w = torch.randn(shape)
        mask = nm_mask(w, n, m)
        assert mask.dtype == torch.bool and mask.shape == w.shape
        assert is_nm(mask, n, m)
        # kept magnitude per group equals the sum of the n largest (brute force)
        groups = w.abs().reshape(-1, m)
        best = groups.sort(dim=1, descending=True).values[:, :n].sum(1)
        kept = (groups * mask.reshape(-1, m)).sum(1)
        torch.testing.assert_close(kept, best)


def test_is_nm_rejects_wrong_counts():
    mask = torch.tensor([[1, 1, 0, 0, 1, 0, 0, 0]], dtype=torch.bool)
    assert not is_nm(mask, 2, 4)
    assert is_nm(torch.tensor([[1, 0, 1, 0]], dtype=torch.bool), 2, 4)
    assert not is_nm(torch.ones(2, 6, dtype=torch.bool), 2, 4)  # 6 not a multiple of 4


def test_nm_shape_error_names_dims():
    with pytest.raises(ValueError, match=r"last \(input\) dim 10 is not a multiple of M=4"):
        nm_mask(torch.randn(3, 10), 2, 4, name="blocks.0.mlp")
    with pytest.raises(ValueError, match="blocks.0.mlp"):
        nm_mask(torch.randn(3, 10), 2, 4, name="blocks.0.mlp")


@pytest.mark.parametrize("sparsity", [0.0, 0.3, 0.5, 0.9, 0.97, 1.0])
def test_topk_exact_count(sparsity):
    torch.manual_seed(0)
    w = torch.randn(13, 17)
    mask = topk_mask(w, sparsity)
    assert int(mask.sum()) == keep_count(w.numel(), sparsity)
    if 0 < int(mask.sum()) < w.numel():
        assert w.abs()[mask].min() >= w.abs()[~mask].max()


def test_topk_per_group_budget():
    w = torch.randn(4, 6, 8)
    w[0] *= 100  # one loud expert must not steal the other experts' budget
    mask = topk_mask(w, 0.75, groups=4)
    assert mask.reshape(4, -1).sum(1).tolist() == [12, 12, 12, 12]


def test_transposable_patterns_are_the_90_valid_blocks():
    p = transposable_patterns().reshape(-1, 4, 4)
    assert p.shape[0] == 90
    assert (p.sum(1) == 2).all() and (p.sum(2) == 2).all()
    assert len({tuple(x.flatten().tolist()) for x in p}) == 90
    brute = sum(
        1
        for bits in itertools.product((0, 1), repeat=16)
        if all(sum(bits[4 * r : 4 * r + 4]) == 2 for r in range(4))
        and all(sum(bits[c::4]) == 2 for c in range(4))
    )
    assert brute == 90


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_transposable_valid_both_ways_and_beats_baselines(seed):
    torch.manual_seed(seed)
    rows, cols = 4 * int(torch.randint(1, 9, (1,))), 4 * int(torch.randint(1, 9, (1,)))
    w = torch.randn(rows, cols)
    mask = transposable_2to4_mask(w)
    assert is_transposable_nm(mask) and is_nm(mask, 2, 4) and is_nm(mask.t(), 2, 4)
    kept = (w.abs() * mask).sum()
    pats = transposable_patterns().reshape(-1, 4, 4).bool()
    # baseline 1: the best single pattern tiled over every block
    best_fixed = max(float((w.abs() * p.repeat(rows // 4, cols // 4)).sum()) for p in pats)
    # baseline 2: a random valid pattern per block
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 90, (rows // 4, cols // 4), generator=g)
    rand = pats[idx].permute(0, 2, 1, 3).reshape(rows, cols)
    assert is_transposable_nm(rand)
    assert kept >= best_fixed - 1e-5
    assert kept >= float((w.abs() * rand).sum()) - 1e-5
    # upper bound: a row-only 2:4 mask is less constrained
    assert kept <= float((w.abs() * nm_mask(w, 2, 4)).sum()) + 1e-5


def test_transposable_is_block_optimal():
    torch.manual_seed(3)
    w = torch.randn(4, 8)
    mask = transposable_2to4_mask(w)
    pats = transposable_patterns().reshape(-1, 4, 4).bool()
    for b in range(2):
        block = w[:, 4 * b : 4 * b + 4].abs()
        best = max(float((block * p).sum()) for p in pats)
        assert abs(float((block * mask[:, 4 * b : 4 * b + 4]).sum()) - best) < 1e-5


def test_transposable_stacked_experts_and_errors():
    w = torch.randn(3, 8, 12)
    mask = transposable_2to4_mask(w)
    assert all(is_transposable_nm(mask[e]) for e in range(3))
    with pytest.raises(ValueError, match="multiples of 4"):
        transposable_2to4_mask(torch.randn(6, 8))
    rows_only = torch.tensor([1, 1, 0, 0], dtype=torch.bool).repeat(
        8, 2
    )  # 2:4 along rows, 4:4 / 0:4 down columns
    assert is_nm(rows_only, 2, 4) and not is_transposable_nm(rows_only)


def test_erk_budget_and_dense_overflow():
    shapes = {"tiny": (4, 4), "mid": (64, 32), "big": (256, 256)}
    numel = {k: v[0] * v[1] for k, v in shapes.items()}
    for s in (0.5, 0.9, 0.95):
        sp = erk_sparsities(shapes, s)
        kept = sum(numel[k] * (1 - sp[k]) for k in shapes)
        assert abs(kept - (1 - s) * sum(numel.values())) < 1e-6 * sum(numel.values())
        assert all(0 <= v < 1 for v in sp.values())
    sp = erk_sparsities(shapes, 0.9)
    # RigL handling: the tiny layer's ERK density would exceed 1, so it is dense
    assert sp["tiny"] == 0.0
    # the others keep density proportional to (out + in) / (out * in)
    ratio = (1 - sp["mid"]) / (1 - sp["big"])
    assert abs(ratio - (96 / 2048) / (512 / 65536)) < 1e-6


def test_flip_rate_hand_example():
    old = torch.tensor([[1, 0, 1, 0], [0, 1, 1, 0]], dtype=torch.bool)
    new = torch.tensor([[1, 0, 0, 1], [0, 1, 1, 0]], dtype=torch.bool)
    assert flip_count(old, new) == 2
    assert flip_rate(old, new) == 2 / 8
    assert flip_rate(old, old) == 0.0
    assert density(old) == 0.5
    with pytest.raises(ValueError):
        flip_rate(old, new[:1])
