"""Collectives run by a group's worker thread behave as if the caller's thread ran them.

A CPU async collective that meshspeed implements itself (ring, hd, bruck, pairwise) runs on the
group's worker thread. torch keeps grad mode per thread, and a fresh thread has it on, while
the caller usually made the output buffers as views inside an autograd Function or under
no_grad: an in-place write into such a view with grad mode on raises. This broke every
expert-parallel run once `meshspeed bench comm` picked the pairwise all-to-all (issue 45).

Every async collective is started here inside an autograd Function's forward, inside its
backward, and under no_grad, writing into views made there, under every algorithm the cost
model can choose (forced one at a time, as MESHSPEED_ALGO does), at world sizes 2 and 3, and
its result is compared with the one computed from every rank's inputs.
"""

from __future__ import annotations

import pytest
import torch

from meshspeed import comm
from meshspeed.comm.algorithms import bounds
from tests import harness

# (op, algorithms the cost model may pick for it on one node)
CASES = [
    ("all_to_all", "native"),
    ("all_to_all", "pairwise"),
    ("all_to_all_v", "native"),
    ("all_to_all_v", "pairwise"),
    ("all_gather", "native"),
    ("all_gather", "ring"),
    ("all_gather", "bruck"),
    ("all_gather_v", "ring"),
    ("all_gather_v", "bruck"),
    ("reduce_scatter", "native"),
    ("reduce_scatter", "ring"),
    ("reduce_scatter", "bruck"),
    ("all_reduce", "native"),
    ("all_reduce", "ring"),
    ("all_reduce", "hd"),
    ("p2p", "native"),
]
WHERE = ("forward", "backward", "no_grad")


def _x(seed: int, *shape) -> torch.Tensor:
    """An input that requires grad, as the input of an autograd Function does (a copy from it
    into a no_grad view is what torch refuses under grad mode)."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return x.requires_grad_()


def _in_views(n: int, *rest) -> list[torch.Tensor]:
    """Two views of one buffer made by a multi-output view op (split): the kind of view whose
    in-place modification under grad mode torch refuses when it was made under no_grad."""
    return list(torch.zeros(2 * n, *rest, dtype=torch.float64).split([n, n]))


def _collective(op: str, g) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `op` async into views made here; return (result, expected)."""
    p, me = g.size, g.rank
    if op in ("all_to_all", "all_to_all_v"):
        ins = [[2] * p for _ in range(p)] if op == "all_to_all" else [
            [(r + 2 * j) % 3 + 1 for j in range(p)] for r in range(p)
        ]
        xs = [_x(10 + r, sum(ins[r]), 3) for r in range(p)]
        want = torch.cat([xs[r].split(ins[r])[me] for r in range(p)])
        out = _in_views(want.shape[0], 3)[0]
        splits = (ins[me], [ins[r][me] for r in range(p)]) if op == "all_to_all_v" else (None, None)
        h = comm.all_to_all(xs[me], g, *splits, out=out, async_op=True)
        return h.wait(), want
    if op in ("all_gather", "all_gather_v"):
        sizes = [2] * p if op == "all_gather" else [r % 2 + 1 for r in range(p)]
        xs = [_x(20 + r, sizes[r], 3) for r in range(p)]
        want = torch.cat(xs)
        out = _in_views(want.shape[0], 3)[1]
        kw = {"sizes": sizes} if op == "all_gather_v" else {}
        return comm.all_gather(xs[me], g, out=out, async_op=True, **kw).wait(), want
    if op == "reduce_scatter":
        xs = [_x(30 + r, 2 * p + 1, 3) for r in range(p)]
        offs = bounds(2 * p + 1, p)
        want = sum(xs)[offs[me] : offs[me + 1]]
        out = _in_views(offs[me + 1] - offs[me], 3)[0]
        return comm.reduce_scatter(xs[me], g, out=out, async_op=True).wait(), want
    if op == "all_reduce":
        xs = [_x(40 + r, 2 * p + 1, 3) for r in range(p)]
        buf = _in_views(2 * p + 1, 3)[1]
        with torch.no_grad():
            buf.copy_(xs[me])
        comm.all_reduce(buf, g, async_op=True).wait()
        return buf, sum(xs)
    if op == "p2p":
        nxt, prv = (me + 1) % p, (me - 1) % p
        out = _in_views(4, 3)[0]
        hs = [comm.isend(_x(50 + me, 4, 3), g, nxt), comm.irecv(out, g, prv)]
        for h in hs:
            h.wait()
        return out, _x(50 + prv, 4, 3)
    raise KeyError(op)


class _InFunction(torch.autograd.Function):
    """Runs `work` in forward or in backward, where torch turns grad mode off."""

    @staticmethod
    def forward(ctx, x, work, where, results):
        ctx.work, ctx.where, ctx.results = work, where, results
        if where == "forward":
            results.append(work())
        return x * 1

    @staticmethod
    def backward(ctx, g):
        if ctx.where == "backward":
            ctx.results.append(ctx.work())
        return g, None, None, None


def job_each_place(ctx, op: str):
    g = ctx.world
    rows = []
    for where in WHERE:
        results: list = []
        work = lambda: _collective(op, g)  # noqa: E731
        if where == "no_grad":
            with torch.no_grad():
                results.append(work())
        else:
            leaf = torch.ones(2, requires_grad=True)
            _InFunction.apply(leaf, work, where, results).sum().backward()
        got, want = (t.detach() for t in results[0])
        rows.append(bool(torch.allclose(got, want, atol=1e-12)))
    return rows


@pytest.mark.parametrize("ws", [2, 3])
@pytest.mark.parametrize("op,algo", CASES, ids=[f"{o}-{a}" for o, a in CASES])
def test_async_collective_under_forced_algorithm_in_autograd_and_no_grad(ws, op, algo):
    base = op.removesuffix("_v")
    forced = {} if op == "p2p" else {base: algo}
    got = harness.run(ws, job_each_place, op, forced_algos=forced)
    assert got == [[True] * len(WHERE)] * ws, f"{op} via {algo}: {dict(zip(WHERE, zip(*got)))}"


def job_worker_inherits_no_grad_and_device(ctx):
    """What the worker thread sees: grad mode off, autocast off, whatever the caller had."""
    seen = {}

    def probe():
        seen.update(grad=torch.is_grad_enabled(), autocast=torch.is_autocast_enabled("cpu"))

    with torch.autocast("cpu", dtype=torch.bfloat16):
        ctx.world.worker().submit(probe).result(timeout=10)
    return seen


def test_worker_runs_with_grad_mode_and_autocast_off():
    assert harness.run(2, job_worker_inherits_no_grad_and_device) == [{"grad": False, "autocast": False}] * 2
