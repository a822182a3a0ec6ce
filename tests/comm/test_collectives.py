"""Every collective × dtype × algorithm × world size 2, 3, 4 against a plain reference.

Each rank builds every rank's input from a seed, so it can compute the exact expected result
locally. Inputs are small integers stored in the tested dtype: sums of up to four of them are
exact in bf16 and fp16 too, so the comparison can be exact whatever order an algorithm adds in.
"""

from __future__ import annotations

import pytest
import torch

from meshspeed import comm
from meshspeed.comm.algorithms import bounds
from tests import harness

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
WORLD_SIZES = [2, 3, 4]


def inp(rank: int, shape, dtype, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + salt)
    return torch.randint(-8, 9, tuple(shape), generator=g).to(dtype)


def _ref_reduce(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    stack = torch.stack([x.double() for x in xs])
    if op in ("sum", "avg"):
        out = stack.sum(0) / (len(xs) if op == "avg" else 1)
    else:
        out = stack.amax(0) if op == "max" else stack.amin(0)
    return out


def _cmp(got: torch.Tensor, want: torch.Tensor, what: str, fails: list, exact: bool = True) -> None:
    if got.shape != want.shape:
        fails.append(f"{what}: shape {list(got.shape)} != {list(want.shape)}")
        return
    got, want = got.double(), want.double()
    tol = 0 if exact else 1e-2 * (want.abs() + 1)
    bad = ((got - want).abs() > tol).sum().item()
    if bad:
        fails.append(f"{what}: {bad} wrong elements")


def _algos(op: str, group) -> list[str]:
    return comm.cost_model.candidates(op, group.nodes, uneven=False)


# ------------------------------------------------------------------------------ job functions
def job_all_reduce(ctx, async_op: bool):
    g, fails = ctx.world, []
    for dtype in DTYPES:
        for op in comm.REDUCE_OPS:
            if op == "avg" and not dtype.is_floating_point:
                continue
            for numel in (1, 7, 64, 1000):
                want = _ref_reduce([inp(r, [numel], dtype) for r in range(g.size)], op)
                for algo in _algos("all_reduce", g):
                    t = inp(ctx.rank, [numel], dtype)
                    res = comm.all_reduce(t, g, op, async_op=async_op, algo=algo)
                    res = res.wait() if async_op else res
                    if res is not t:
                        fails.append(f"all_reduce {algo} did not work in place")
                    _cmp(
                        t,
                        want if op == "avg" else want.to(dtype),
                        f"{op} {dtype} n={numel} {algo}",
                        fails,
                        exact=op != "avg",
                    )
    return fails


def job_all_gather(ctx, async_op: bool):
    g, fails = ctx.world, []
    for dtype in DTYPES:
        for shape, dim in (([3, 5], 0), ([3, 5], 1), ([1], 0), ([2, 3, 4], -1)):
            want = torch.cat([inp(r, shape, dtype) for r in range(g.size)], dim)
            for algo in _algos("all_gather", g):
                h = comm.all_gather(inp(ctx.rank, shape, dtype), g, dim, async_op=async_op, algo=algo)
                _cmp(h.wait() if async_op else h, want, f"{dtype} {shape} dim={dim} {algo}", fails)
        # uneven: member r contributes r+1 rows (backends cannot; meshspeed's algorithms can)
        sizes = [r + 1 for r in range(g.size)]
        want = torch.cat([inp(r, [sizes[r], 3], dtype) for r in range(g.size)], 0)
        for algo in ("ring", "bruck", None):
            h = comm.all_gather(
                inp(ctx.rank, [sizes[ctx.rank], 3], dtype), g, 0, sizes=sizes, async_op=async_op, algo=algo
            )
            _cmp(h.wait() if async_op else h, want, f"uneven {dtype} {algo}", fails)
    return fails


def job_reduce_scatter(ctx, async_op: bool):
    g, p, fails = ctx.world, ctx.world.size, []
    for dtype in DTYPES:
        for op in ("sum", "max", "avg"):
            if op == "avg" and not dtype.is_floating_point:
                continue
            for shape, dim in (
                ([p * 3, 4], 0),
                ([7, 4], 0),
                ([5], 0),
                ([2, p * 2], 1),
                ([3, 7], 1),
                ([1], 0),
            ):
                full = _ref_reduce([inp(r, shape, dtype) for r in range(p)], op)
                offs = bounds(shape[dim], p)
                want = full.narrow(dim, offs[g.rank], offs[g.rank + 1] - offs[g.rank])
                uneven = shape[dim] % p != 0
                for algo in comm.cost_model.candidates("reduce_scatter", g.nodes, uneven) + [None]:
                    h = comm.reduce_scatter(
                        inp(ctx.rank, shape, dtype), g, op, dim, async_op=async_op, algo=algo
                    )
                    got = h.wait() if async_op else h
                    _cmp(
                        got,
                        want if op == "avg" else want.to(dtype),
                        f"{op} {dtype} {shape} dim={dim} {algo}",
                        fails,
                        exact=op != "avg",
                    )
    return fails


def job_broadcast(ctx, async_op: bool):
    g, fails = ctx.world, []
    for dtype in DTYPES:
        for src in range(g.size):
            for shape in ([1], [4, 6]):
                t = inp(ctx.rank, shape, dtype, salt=src)
                h = comm.broadcast(t, g, src, async_op=async_op)
                if async_op:
                    h.wait()
                _cmp(t, inp(src, shape, dtype, salt=src), f"{dtype} src={src} {shape}", fails)
    return fails


def _splits(p: int, r: int) -> list[int]:
    """Rows member r sends to each member: uneven, some zero."""
    return [(r + 2 * j) % 3 for j in range(p)]


def job_all_to_all(ctx, async_op: bool):
    g, p, me, fails = ctx.world, ctx.world.size, ctx.world.rank, []
    for dtype in DTYPES:
        for algo in _algos("all_to_all", g):
            # equal splits
            rows = 2 * p
            xs = [inp(r, [rows, 3], dtype) for r in range(p)]
            want = torch.cat([xs[r].chunk(p)[me] for r in range(p)])
            h = comm.all_to_all(xs[me].clone(), g, async_op=async_op, algo=algo)
            _cmp(h.wait() if async_op else h, want, f"equal {dtype} {algo}", fails)
            # uneven splits
            ins = [_splits(p, r) for r in range(p)]
            xs = [inp(r, [sum(ins[r]), 2], dtype, salt=7) for r in range(p)]
            want = torch.cat([xs[r].split(ins[r])[me] for r in range(p)])
            outs = [ins[r][me] for r in range(p)]
            h = comm.all_to_all(xs[me].clone(), g, ins[me], outs, async_op=async_op, algo=algo)
            _cmp(h.wait() if async_op else h, want, f"uneven {dtype} {algo}", fails)
    return fails


def job_p2p_and_barrier(ctx, _async_op: bool):
    g, p, me, fails = ctx.world, ctx.world.size, ctx.world.rank, []
    for dtype in DTYPES:
        # ring pass with one batched exchange, then a plain send/recv pair between 0 and p-1
        out = torch.empty(5, dtype=dtype)
        comm.batch(
            [comm.P2P("send", inp(me, [5], dtype), (me + 1) % p), comm.P2P("recv", out, (me - 1) % p)], g
        ).wait()
        _cmp(out, inp((me - 1) % p, [5], dtype), f"batch ring {dtype}", fails)
        if me == 0:
            comm.send(inp(0, [3], dtype, salt=3), g, p - 1, tag=5)
        elif me == p - 1:
            _cmp(
                comm.recv(torch.empty(3, dtype=dtype), g, 0, tag=5),
                inp(0, [3], dtype, salt=3),
                "send/recv",
                fails,
            )
    comm.barrier(g)
    return fails


def job_concurrent_async(ctx, _):
    """Two algorithm collectives in flight at once on the same group (worker thread and caller
    thread) must not mix their messages: their p2p tags carry the sequence number."""
    g, fails = ctx.world, []
    a, b = inp(ctx.rank, [300], torch.float32), inp(ctx.rank, [301], torch.float32, salt=1)
    ha = comm.all_reduce(a, g, algo="ring", async_op=True)
    hb = comm.all_reduce(b, g, algo="hd", async_op=True)
    c = comm.reduce_scatter(inp(ctx.rank, [g.size * 5], torch.float32, salt=2), g, algo="bruck")
    ha.wait(), hb.wait()
    _cmp(a, _ref_reduce([inp(r, [300], torch.float32) for r in range(g.size)], "sum"), "ring async", fails)
    _cmp(
        b,
        _ref_reduce([inp(r, [301], torch.float32, salt=1) for r in range(g.size)], "sum"),
        "hd async",
        fails,
    )
    full = _ref_reduce([inp(r, [g.size * 5], torch.float32, salt=2) for r in range(g.size)], "sum")
    _cmp(c, full.chunk(g.size)[g.rank], "bruck sync meanwhile", fails)
    return fails


JOBS = [
    job_all_reduce,
    job_all_gather,
    job_reduce_scatter,
    job_broadcast,
    job_all_to_all,
    job_p2p_and_barrier,
]


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("job", JOBS, ids=lambda j: j.__name__[4:])
def test_collective_matches_reference(ws, job):
    results = harness.run(ws, job, False)
    assert results == [[]] * ws, "\n".join(f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs[:10])


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("job", JOBS[:5] + [job_concurrent_async], ids=lambda j: j.__name__[4:])
def test_async_collective_matches_reference(ws, job):
    results = harness.run(ws, job, True)
    assert results == [[]] * ws, "\n".join(f"rank {r}: {f}" for r, fs in enumerate(results) for f in fs[:10])


def job_hier(ctx, _):
    """Pretend the 4 ranks sit on 2 nodes of 2 so the hierarchical all-reduce has work to do."""
    ctx.ranks_per_node = 2
    g = ctx.split([list(range(ctx.world_size))], "two_nodes")
    fails = []
    if g.nodes != [0, 0, 1, 1]:
        fails.append(f"nodes {g.nodes}")
    for dtype in DTYPES:
        for numel in (1, 5, 257):
            for async_op in (False, True):
                t = inp(ctx.rank, [numel], dtype)
                h = comm.all_reduce(t, g, "sum", algo="hier", async_op=async_op)
                if async_op:
                    h.wait()
                _cmp(
                    t,
                    _ref_reduce([inp(r, [numel], dtype) for r in range(4)], "sum").to(dtype),
                    f"hier {dtype} {numel}",
                    fails,
                )
    if "hier" not in comm.cost_model.candidates("all_reduce", g.nodes, False):
        fails.append("hier not offered on a 2x2 layout")
    return fails


def test_hierarchical_all_reduce_on_two_simulated_nodes():
    assert harness.run(4, job_hier, None, ranks_per_node=2) == [[]] * 4


def job_bad_calls(ctx, _):
    g, msgs = ctx.world, []
    for call in (
        lambda: comm.all_reduce(torch.ones(2, dtype=torch.int64), g, "avg"),
        lambda: comm.all_reduce(torch.ones(2), g, "prod"),
        lambda: comm.all_reduce(torch.ones(2), g, algo="bruck"),
        lambda: comm.all_reduce(torch.ones(2), g, algo="hier"),
        lambda: comm.reduce_scatter(torch.ones(g.size + 1), g, algo="native"),
        lambda: comm.all_to_all(torch.ones(g.size + 1), g),
        lambda: comm.broadcast(torch.ones(2), g, src=g.size),
    ):
        try:
            call()
            msgs.append(None)
        except comm.ConfigError as err:
            msgs.append(str(err))
    return msgs


def test_bad_arguments_fail_with_one_clear_line():
    msgs = harness.run(2, job_bad_calls, None)[0]
    assert all(m and "\n" not in m for m in msgs), msgs
    assert "use op='sum'" in msgs[0] and "valid: sum, avg, max, min" in msgs[1]
    assert "valid: native, ring, hd, hier" in msgs[2]
    assert "does not span several nodes" in msgs[3] and "uneven" in msgs[4]
