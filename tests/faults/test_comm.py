"""Communication-layer guarantees behind the fault tests: every group carries the timeout, fp16
averages do not overflow, and the comm package's imports form no cycle."""

from __future__ import annotations

import ast
import os

import pytest
import torch

from meshspeed import comm
from tests import harness

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _group_timeouts(ctx) -> dict:
    out = {}
    for dims in (comm.ParallelDims(dp=2, tp=2), comm.ParallelDims(dp=4)):  # dp=4: a dim spanning the world
        mesh = dims.build(ctx)
        for name in mesh.GROUPS:
            g = mesh[name]
            if g.pg is not None:  # size-1 groups never wait
                backend = g.pg._get_backend(torch.device("cpu"))
                out[g.name] = (backend.options._timeout.total_seconds(), g.backend_timeout_s)
    return out


def test_every_group_carries_the_timeout():
    """torch gives DeviceMesh and new_group groups its own default (30 min on gloo) unless told;
    a stopped rank would then hang tp/dp collectives for half an hour."""
    for per_rank in harness.run(4, _group_timeouts):
        assert {"world", "node[0-3]", "dp[0-3]"} <= set(per_rank)
        assert any(n.startswith("tp[") for n in per_rank)
        for name, (backend_s, known_s) in per_rank.items():
            assert backend_s == harness.TEST_COMM_TIMEOUT_S == known_s, (name, backend_s, known_s)


def _fp16_avg(ctx, algo: str):
    group = comm.ParallelDims(dp=ctx.world_size).build(ctx)["dp"]
    x = torch.full((6,), 40000.0, dtype=torch.float16)  # two of these sum past fp16's 65504
    y = comm.all_reduce(x.clone(), group, "avg", algo=algo)
    h = comm.all_reduce(x.clone(), group, "avg", algo=algo, async_op=True).wait()
    rs = comm.reduce_scatter(x.clone(), group, "avg")
    out = torch.empty(3, dtype=torch.float16)
    rs_out = comm.reduce_scatter(x.clone(), group, "avg", out=out)
    right = [t.dtype == torch.float16 and bool((t == 40000.0).all()) for t in (y, h, rs, rs_out)]
    return right + [rs_out is out]


@pytest.mark.parametrize("algo", ["native", "ring", "hd"])
def test_fp16_average_of_large_values_does_not_overflow(algo):
    assert harness.run(2, _fp16_avg, algo) == [[True] * 5] * 2


# -- imports ---------------------------------------------------------------------------------
def _modules() -> dict[str, str]:
    mods = {}
    for d, _, files in os.walk(os.path.join(ROOT, "meshspeed")):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), ROOT)[:-3].replace(os.sep, ".")
                mods[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(d, f)
    return mods


def _module_level_imports(tree):
    """Imports that run when the module is imported, including those under `if TYPE_CHECKING`
    (a cycle a type checker follows is still a cycle) but not those inside functions."""
    out, todo = [], list(tree.body)
    while todo:
        n = todo.pop()
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            out.append(n)
        elif isinstance(n, (ast.If, ast.Try, ast.With)):
            todo += n.body + getattr(n, "orelse", []) + getattr(n, "finalbody", [])
            todo += [s for h in getattr(n, "handlers", []) for s in h.body]
    return out


def _graph() -> dict[str, set[str]]:
    mods, graph = _modules(), {}
    for m, path in mods.items():
        pkg = m if path.endswith("__init__.py") else m.rpartition(".")[0]
        edges = set()
        for n in _module_level_imports(ast.parse(open(path).read())):
            if isinstance(n, ast.Import):
                edges |= {a.name for a in n.names}
                continue
            base = n.module or ""
            if n.level:
                parts = pkg.split(".")[: len(pkg.split(".")) - n.level + 1]
                base = ".".join(parts + ([n.module] if n.module else []))
            edges |= {f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in n.names}
        graph[m] = {e for e in edges if e in mods and e != m}
    return graph


def test_no_import_cycles():
    graph, state, cycles = _graph(), {}, []

    def visit(m, path):
        state[m] = "open"
        for nxt in sorted(graph[m]):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


OWNED = [
    "meshspeed/comm/" + f
    for f in (
        "context.py",
        "group.py",
        "desync.py",
        "launch.py",
        "mesh.py",
        "errors.py",
        "collectives.py",
        "trace.py",
        "protocols.py",
    )
] + [
    "meshspeed/checkpoint/dirs.py",
    "meshspeed/checkpoint/manifest.py",
    "meshspeed/plan/config.py",
    "meshspeed/train/metrics.py",
    "meshspeed/train/job.py",
]


@pytest.mark.parametrize("path", OWNED)
def test_no_private_names_imported_across_modules(path):
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    private = [
        f"{n.module}.{a.name}"
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("meshspeed")
        for a in n.names
        if a.name.startswith("_")
    ]
    assert not private, f"{path} imports private names: {private}"
