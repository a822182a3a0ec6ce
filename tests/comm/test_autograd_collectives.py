"""Differentiable collectives against the single-process computation, forward and gradients.

Each rank rebuilds every rank's input from a seed and evaluates the *global* function the
distributed one implements — loss = Σ_s <out_s, w_s> over the ranks s whose outputs are
distinct, or <out, w> once for an output every rank holds a copy of (it is one logical
tensor) — then autograd gives the exact gradient of each rank's input. The distributed run
must reproduce this rank's output and input gradient.
"""

from __future__ import annotations

import pytest
import torch

from meshspeed import comm
from meshspeed.comm.algorithms import bounds
from tests import harness


def rnd(seed: int, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def chunk(x: torch.Tensor, p: int, i: int, dim: int) -> torch.Tensor:
    offs = bounds(x.shape[dim], p)
    return x.narrow(dim, offs[i], offs[i + 1] - offs[i])


# Per op: (input shape for rank r, replicated input?, global output at rank s, replicated output?)
def _case(name: str, p: int, n: int):
    d = 1  # the sharded dimension
    sizes = [bounds(n, p)[i + 1] - bounds(n, p)[i] for i in range(p)]
    if name == "copy_to":
        return (lambda r: (2, n, 3)), True, (lambda xs, s: xs[0] * 1), False, lambda x, g: comm.copy_to(x, g)
    if name == "reduce_from":
        return (
            (lambda r: (2, n, 3)),
            False,
            (lambda xs, s: sum(xs)),
            True,
            lambda x, g: comm.reduce_from(x, g),
        )
    if name == "split_to":
        return (
            (lambda r: (2, n, 3)),
            True,
            (lambda xs, s: chunk(xs[0], p, s, d)),
            False,
            lambda x, g: comm.split_to(x, g, d),
        )
    if name == "gather_from":
        return (
            (lambda r: (2, sizes[r], 3)),
            False,
            (lambda xs, s: torch.cat(xs, d)),
            True,
            lambda x, g: comm.gather_from(x, g, d, sizes=sizes),
        )
    if name == "gather_sp":
        return (
            (lambda r: (2, sizes[r], 3)),
            False,
            (lambda xs, s: torch.cat(xs, d)),
            False,
            lambda x, g: comm.gather_sp(x, g, d, sizes=sizes),
        )
    if name == "reduce_scatter_sp":
        return (
            (lambda r: (2, n, 3)),
            False,
            (lambda xs, s: chunk(sum(xs), p, s, d)),
            False,
            lambda x, g: comm.reduce_scatter_sp(x, g, d),
        )
    raise KeyError(name)


def job_autograd(ctx, name: str, n: int):
    g, p, me = ctx.world, ctx.world.size, ctx.world.rank
    shape, rep_in, ref, rep_out, fn = _case(name, p, n)
    xs = [rnd(0 if rep_in else 10 + r, *shape(r)).requires_grad_() for r in range(p)]
    outs = [ref(xs, s) for s in range(p)]
    ws = [rnd(50 if rep_out else 50 + s, *outs[s].shape) for s in range(p)]
    loss = (outs[0] * ws[0]).sum() if rep_out else sum((o * w).sum() for o, w in zip(outs, ws))
    loss.backward()
    want_grad = xs[0].grad if rep_in else xs[me].grad

    x = rnd(0 if rep_in else 10 + me, *shape(me)).requires_grad_()
    out = fn(x, g)
    (out * ws[me]).sum().backward()
    return [torch.allclose(out, outs[me].detach(), atol=1e-12), torch.allclose(x.grad, want_grad, atol=1e-12)]


def job_all_to_all_autograd(ctx):
    g, p, me = ctx.world, ctx.world.size, ctx.world.rank
    ins = [[(r + 2 * j) % 3 + 1 for j in range(p)] for r in range(p)]
    xs = [rnd(30 + r, sum(ins[r]), 4).requires_grad_() for r in range(p)]
    outs = [torch.cat([xs[r].split(ins[r])[s] for r in range(p)]) for s in range(p)]
    ws = [rnd(70 + s, *outs[s].shape) for s in range(p)]
    sum((o * w).sum() for o, w in zip(outs, ws)).backward()
    x = rnd(30 + me, sum(ins[me]), 4).requires_grad_()
    out = comm.all_to_all_ad(x, g, ins[me], [ins[r][me] for r in range(p)])
    (out * ws[me]).sum().backward()
    return [torch.allclose(out, outs[me].detach()), torch.allclose(x.grad, xs[me].grad)]


OPS = ["copy_to", "reduce_from", "split_to", "gather_from", "gather_sp", "reduce_scatter_sp"]


@pytest.mark.parametrize("ws", [2, 3, 4])
@pytest.mark.parametrize("name", OPS)
def test_autograd_collective_matches_single_process(ws, name):
    for n in (ws * 2, 2 * ws + 1):  # even and uneven shards
        assert harness.run(ws, job_autograd, name, n) == [[True, True]] * ws, f"{name} n={n}"


@pytest.mark.parametrize("ws", [2, 3, 4])
def test_all_to_all_autograd_matches_single_process(ws):
    assert harness.run(ws, job_all_to_all_autograd) == [[True, True]] * ws
