"""The package's imports follow the layers of docs/design.md: no cycles, nothing pointing up,
no private names imported across modules.

Every import counts, wherever it is written (module level, inside a function, under
TYPE_CHECKING): a lazy import that closes a cycle is still a cycle, only hidden.
"""

from __future__ import annotations

import ast
import pathlib

import meshspeed

ROOT = pathlib.Path(meshspeed.__file__).parent

# package -> meshspeed packages it must never import (docs/design.md, "Layering")
UP_FROM_MODELS = {"checkpoint", "data", "interop", "plan", "train", "infer", "commands", "bench"}
FORBIDDEN = {
    "comm": {"kernels", "parallel", "memory", "sparse", "models"} | UP_FROM_MODELS,
    "kernels": {"parallel", "memory", "sparse", "models"} | UP_FROM_MODELS,
    "parallel": {"models"} | UP_FROM_MODELS,
    "memory": {"models"} | UP_FROM_MODELS,
    "sparse": {"models"} | UP_FROM_MODELS,
    "models": {"parallel", "memory"} | UP_FROM_MODELS,
    # checkpoint/ and data/ sit beside models/: only comm/ (and sparse/ for masked export) below them
    "checkpoint": {"kernels", "parallel", "memory", "models"} | UP_FROM_MODELS - {"checkpoint"},
    "data": {"kernels", "parallel", "memory", "sparse", "models"} | UP_FROM_MODELS - {"data"},
    "interop": {"plan", "train", "infer", "commands", "bench"},
    "plan": {"train", "infer", "commands", "bench"},
    "train": {"infer", "commands", "bench"},
    "infer": {"train", "plan", "commands", "bench"},
    # meshspeed.losses: pure torch functions for users' own loops, importable without the library
    "losses": {"comm", "kernels", "parallel", "memory", "sparse", "models"} | UP_FROM_MODELS,
}


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def _imports(name: str, path: pathlib.Path, known: set[str]) -> list[tuple[str, list[str], int]]:
    """(imported module, names imported from it, line) for every meshspeed import in the file."""
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.startswith("meshspeed")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("meshspeed"):
                continue
            names = [a.name for a in node.names]
            # `from pkg import submodule` imports the submodule
            subs = [f"{mod}.{n}" for n in names if f"{mod}.{n}" in known]
            out += [(s, [], node.lineno) for s in subs]
            rest = [n for n in names if f"{mod}.{n}" not in known]
            if rest or not subs:
                out.append((mod, rest, node.lineno))
    return out


def _graph():
    mods = _modules()
    known = set(mods)
    return mods, {m: _imports(m, p, known) for m, p in mods.items()}


def _package(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else None


def test_layers_point_down():
    _, graph = _graph()
    bad = []
    for mod, imps in graph.items():
        pkg = _package(mod)
        for target, _, line in imps:
            if _package(target) in FORBIDDEN.get(pkg, ()):
                bad.append(f"{mod}:{line} imports {target} ({pkg} must not import {_package(target)})")
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    _, graph = _graph()
    # a package's __init__ re-exporting its own modules is not a cycle of the code, so edges
    # into a package __init__ from inside that same package are dropped
    edges = {
        m: sorted({t for t, _, _ in imps if t != m and not (m.startswith(t + ".") and t in graph)})
        for m, imps in graph.items()
    }
    cycles, state, stack = [], {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in edges.get(m, ()):
            if t not in edges:
                continue
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t) :] + [t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_private_names_imported_across_modules():
    _, graph = _graph()
    bad = [
        f"{mod}:{line} imports {n} from {target}"
        for mod, imps in graph.items()
        for target, names, line in imps
        for n in names
        if n.startswith("_") and not n.startswith("__")
    ]
    assert not bad, "\n".join(bad)


MAX_LINES = 450  # docs/design.md: a file is read in one sitting; past this it splits along a named seam


def test_files_stay_small():
    long = {
        str(p.relative_to(ROOT.parent)): n
        for p in ROOT.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines (split along a named seam): {long}"
