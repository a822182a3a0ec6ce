"""ParallelDims validation, coordinates and the groups a mesh builds."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from meshspeed import comm
from meshspeed.comm import ConfigError, ParallelDims
from tests import harness, warm


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"tp": 0}, "parallel.tp=0 must be an integer ≥ 1"),
        ({"dp": 2.0}, "parallel.dp=2.0 must be an integer ≥ 1"),
        ({"dp": 2, "ep": 3}, "parallel.ep=3 must divide dp×cp = 2"),
        ({"dp": 2, "cp": 3, "ep": 4}, "valid: 1, 2, 3, 6"),
    ],
)
def test_invalid_degrees_fail_with_one_line(kwargs, needle):
    with pytest.raises(ConfigError) as err:
        ParallelDims(**kwargs)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_world_size_mismatch_suggests_a_fix():
    with pytest.raises(
        ConfigError, match=r"dp=2 × pp=1 × cp=1 × tp=3 = 6 ranks, but the world size is 4.*dp=4"
    ):
        ParallelDims(dp=2, tp=3).check_world(4)
    with pytest.raises(ConfigError, match=r"e.g. dp=2 with the other degrees"):
        ParallelDims(dp=1, tp=2).check_world(4)


def test_coordinates_follow_the_documented_layout():
    dims = ParallelDims(dp=2, pp=2, cp=2, tp=2, ep=2)
    seen = set()
    for rank in range(16):
        c = dims.coords(rank)
        assert rank == ((c["pp"] * 2 + c["dp"]) * 2 + c["cp"]) * 2 + c["tp"]
        assert c["ep"] == (c["dp"] * 2 + c["cp"]) % 2 and c["edp"] == (c["dp"] * 2 + c["cp"]) // 2
        seen.add((c["pp"], c["dp"], c["cp"], c["tp"]))
    assert len(seen) == 16


def test_partitions_cover_the_world_once_each():
    dims = ParallelDims(dp=3, cp=2, tp=2, ep=3)
    parts = dims.partitions()
    for name, groups in parts.items():
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(12)), name
    assert parts["tp"][0] == [0, 1] and parts["cp"][0] == [0, 2] and parts["dp"][0] == [0, 4, 8]
    assert parts["dp_cp"][0] == [0, 2, 4, 6, 8, 10]
    assert parts["ep"][:2] == [[0, 2, 4], [6, 8, 10]] and parts["edp"][0] == [0, 6]


def job_mesh(ctx, kwargs):
    dims = ParallelDims(**kwargs)
    mesh = dims.build(ctx)
    assert dims.build(ctx) is mesh  # built once per context
    out = {"coords": mesh.coords}
    for name in ("pp", "dp", "cp", "tp", "dp_cp", "ep", "edp", "node", "xnode"):
        g = mesh[name]
        total = comm.all_reduce(torch.tensor([ctx.rank]), g).item()
        out[name] = [g.ranks, total]
    out["device_mesh"] = list(mesh.device_mesh.mesh_dim_names) if mesh.device_mesh is not None else None
    if mesh.device_mesh is not None:
        out["dm_tp"] = mesh.device_mesh["tp"].mesh.tolist()
    return out


@pytest.mark.parametrize(
    "ws,kwargs",
    [
        (4, {"dp": 2, "tp": 2}),
        (4, {"pp": 2, "dp": 2, "ep": 2}),
        (4, {"cp": 2, "tp": 2}),
        (3, {"dp": 3, "ep": 3}),
        (2, {"pp": 2}),
    ],
)
def test_mesh_groups_hold_the_right_ranks(ws, kwargs):
    dims = ParallelDims(**kwargs)
    parts = dims.partitions()
    results = harness.run(ws, job_mesh, kwargs)
    for rank, out in enumerate(results):
        assert out["coords"] == dims.coords(rank)
        for name in ("pp", "dp", "cp", "tp", "dp_cp", "ep", "edp"):
            mine = next(g for g in parts[name] if rank in g)
            assert out[name] == [mine, sum(mine)], (rank, name)
        assert out["node"][0] == list(range(ws)) and out["xnode"][0] == [rank]  # one node
        assert out["device_mesh"] == ["pp", "dp", "cp", "tp"]
        assert out["dm_tp"] == next(g for g in parts["tp"] if rank in g)


def job_two_node_topology(ctx):
    mesh = ParallelDims(dp=4).build(ctx)
    return [mesh["node"].ranks, mesh["xnode"].ranks, mesh["world"].nodes]


def test_intra_and_inter_node_groups_follow_ranks_per_node():
    results = harness.run(4, job_two_node_topology, ranks_per_node=2, _meshes={})
    assert [r[:2] for r in results] == [
        [[0, 1], [0, 2]],
        [[0, 1], [1, 3]],
        [[2, 3], [0, 2]],
        [[2, 3], [1, 3]],
    ]


def test_single_process_needs_no_process_group():
    code = (
        "import torch, torch.distributed as dist\n"
        "from meshspeed import comm\n"
        "ctx = comm.init()\n"
        "mesh = comm.ParallelDims().build(ctx)\n"
        "x = torch.arange(4.)\n"
        "assert comm.all_reduce(x, mesh['dp']) is x and x.tolist() == [0, 1, 2, 3]\n"
        "assert comm.all_gather(x, mesh['tp']) is x\n"
        "assert comm.reduce_scatter(x, mesh['tp']) is x\n"
        "assert comm.all_reduce(x, mesh['dp'], async_op=True).wait() is x\n"
        "y = comm.reduce_from(comm.copy_to(x.requires_grad_(), mesh['tp']), mesh['tp']).sum(); y.backward()\n"
        "assert not dist.is_initialized() and mesh.device_mesh is None and mesh.coords['tp'] == 0\n"
        "print('ok')\n"
    )
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    out = warm.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


def test_world_mismatch_at_build_time_is_one_line():
    code = (
        "from meshspeed import comm\n"
        "try:\n"
        "    comm.ParallelDims(tp=2).build(comm.init())\n"
        "except comm.ConfigError as e:\n"
        "    print(e)\n"
    )
    out = warm.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "WORLD_SIZE"},
    )
    assert out.stdout.strip().startswith(
        "parallel degrees dp=1 × pp=1 × cp=1 × tp=2 = 2 ranks, but the world size is 1"
    )
