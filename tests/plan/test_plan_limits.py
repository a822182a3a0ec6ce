"""`meshspeed plan` on worlds from one rank to the bound (issue 44, item 7): groups are formed in
closed form (the planner asked `ParallelDims.partitions()` for every group of the world, and
looped over every rank for its representatives: 7 s at 10^4 ranks, 63 s at 10^5, hours at
10^7), a world past the bound and `--gpus-per-node 0` are one line, and "no layout" says why."""

from __future__ import annotations

import itertools
import sys

import pytest

from meshspeed import cli
from meshspeed.comm.mesh import ParallelDims
from meshspeed.plan import config
from meshspeed.plan.machine import get_machine
from meshspeed.plan.planner import evaluate, representatives
from tests import warm

SMALL = list(itertools.product((1, 2, 3, 4, 6), (1, 2, 3), (1, 2), (1, 2, 4)))


def _layouts():
    for dp, pp, cp, tp in SMALL:
        for ep in [e for e in range(1, dp * cp + 1) if dp * cp % e == 0]:
            for etp, fold in ((0, False), (1, False), (1, True)):
                yield ParallelDims(dp=dp, pp=pp, cp=cp, tp=tp, ep=ep, etp=etp, tp_extend_ep=fold)


def test_members_are_the_partition_holding_the_rank():
    """The closed form against the tensor reshapes every process group is built from."""
    for dims in _layouts():
        for name, groups in dims.partitions().items():
            for group in groups:
                for rank in group:
                    assert dims.members(name, rank) == group, (dims, name, rank)


def test_representatives_are_the_first_rank_of_each_distinct_coordinate():
    for dims in _layouts():
        seen, want = set(), []
        for r in range(dims.world_size):
            c = dims.coords(r)
            if (c["pp"], c["tp"], c["ep"]) not in seen:
                seen.add((c["pp"], c["tp"], c["ep"]))
                want.append(r)
        assert representatives(dims) == want, dims


def test_a_layout_of_a_million_ranks_is_planned_without_visiting_each_rank(monkeypatch):
    """No partition of the world and no per-rank loop: `coords` is asked of a few ranks only."""
    world = 2**20
    calls = []
    coords = ParallelDims.coords
    monkeypatch.setattr(ParallelDims, "partitions", lambda self: pytest.fail("partitions() of the world"))
    monkeypatch.setattr(ParallelDims, "coords", lambda self, r: calls.append(r) or coords(self, r))
    cfg = config.load(None, [("train.global_batch_size", str(world))])
    settings = {"parallel.tp": 2, "parallel.pp": 2, "parallel.zero": 1, "parallel.sequence_parallel": True}
    r = evaluate(cfg, world, get_machine("h100"), settings)
    assert "predicted" in r and r["predicted"]["comm_s"]["dp"] > 0, r
    assert len(calls) < 1000, len(calls)


def test_a_world_past_the_bound_is_one_line_not_hours():
    """A subprocess with a generous bound: before, this ran for hours."""
    cmd = [sys.executable, "-m", "meshspeed", "plan", "--nproc", "10000000"]
    done = warm.run(cmd + ["--train.global_batch_size", "10000000"], timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip() == (
        "meshspeed plan: --nproc=10,000,000 ranks is more than the planner takes (1,048,576); plan at most "
        "1,048,576 ranks (layouts repeat: plan one pod of the cluster)"
    ), done.stderr


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--nproc", "4", "--gpus-per-node", "0"], "--gpus-per-node=0 must be ≥ 1; e.g. --gpus-per-node 8"),
        (["--nodes", "2", "--gpus-per-node", "0"], "--gpus-per-node=0 must be ≥ 1; e.g. --gpus-per-node 8"),
        (["--nodes", "0", "--gpus-per-node", "8"], "--nodes 0 needs --gpus-per-node N (both ≥ 1)"),
    ],
)
def test_bad_node_shapes_are_one_line(capsys, argv, line):
    assert cli.main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"meshspeed plan: {line}") and "\n" not in err, err


def test_no_layout_to_try_says_why(capsys):
    """No split of 100,000 ranks divides a batch of 16: before, "first reasons:" and nothing."""
    assert cli.main(["plan", "--nproc", "100000", "--train.global_batch_size", "16"]) == 1
    out = capsys.readouterr().out.strip()
    assert out == (
        "meshspeed plan: no layout to try: no split of 100,000 ranks into tp × pp × cp leaves a "
        "data-parallel degree that divides train.global_batch_size=16; raise it (e.g. "
        "--train.global_batch_size 100000) or plan fewer ranks"
    ), out
