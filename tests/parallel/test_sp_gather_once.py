"""Sequence parallelism gathers each activation once: sibling projections that read the same
tensor (q, k, v; gate, up) share one all-gather forward and one reduce-scatter backward.

Under SP every column-parallel linear needs its input gathered along the sequence; gathering
it once per reader tripled the collectives of attention and doubled the MLP's, and left tp + SP
at 0.90× DTensor TP+SP's speed on CPU (issue 45). The counts are read from the flight recorder
of a real forward and backward; parity with one device is tests/parallel/test_tensor.py's.
"""

from __future__ import annotations

import torch

from meshspeed import comm
from meshspeed.models import build_model, get_preset, recipe_for
from meshspeed.parallel.tensor import _gather_once, model_loss, parallelize
from tests import harness


def _ops(ctx, fn) -> dict[str, int]:
    mark = ctx.recorder.mark()
    fn()
    counts: dict[str, int] = {}
    for e in ctx.recorder.since(mark):
        if e["group"].startswith("tp"):
            counts[e["op"]] = counts.get(e["op"], 0) + 1
    return counts


def job_collectives_per_step(ctx, n_layers: int):
    config = get_preset("tiny", n_layers=n_layers)
    mesh = comm.ParallelDims(tp=ctx.world_size).build(ctx)
    model = parallelize(build_model(config, seed=0), mesh, recipe_for(config), sequence_parallel=True)
    tokens = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    return _ops(ctx, lambda: model_loss(model, tokens, tokens, aux=False).backward())


def test_one_gather_and_one_reduce_scatter_per_block_input():
    """Per block: one gather into attention (q, k, v), one into the MLP (gate, up), one
    reduce-scatter out of each (o, down); plus the embedding's reduce-scatter and the head's
    gather. Backward mirrors them. Gathering per reader would give 3 + 2 per block."""
    for n_layers in (1, 3):
        got = harness.run(2, job_collectives_per_step, n_layers)[0]
        per_side = 2 * n_layers + 1
        assert got["all_gather"] == 2 * per_side and got["reduce_scatter"] == 2 * per_side, got


def job_reuse_rules(ctx):
    g = ctx.world
    x = torch.arange(8.0).reshape(1, 4, 2).add(10 * g.rank).requires_grad_()
    h = x * 1  # a non-leaf, like a norm's output
    a = _gather_once(h, g)
    same = _gather_once(h, g) is a  # the sibling reuses it
    with torch.no_grad():
        other_mode = _gather_once(h, g) is not a  # not across grad modes
    h2 = h.detach().clone()
    c = _gather_once(h2, g)  # kept alive, as a matmul saving it for backward would
    fresh = c is not a  # another tensor, same values
    with torch.no_grad():
        h2.add_(1.0)  # changed in place: its gather is stale
    b = _gather_once(h2, g)
    want = torch.cat([torch.arange(8.0).reshape(1, 4, 2) + 10 * r + 1 for r in range(g.size)], 1)
    # the gradient of two readers is summed before the one reduce-scatter
    (a.sum() + _gather_once(h, g).mul(2).sum()).backward()
    summed = torch.equal(x.grad, torch.full_like(x, 3.0 * g.size))
    return [same, other_mode, fresh, torch.equal(b, want), summed]


def test_reuse_only_for_the_same_unchanged_tensor_in_the_same_grad_mode():
    assert harness.run(2, job_reuse_rules) == [[True] * 5] * 2
