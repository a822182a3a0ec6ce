"""α-β-γ cost model: predicted time of each collective algorithm, fitted link parameters, choice.

T = a·α + b·β + c·γ per link class, with α the per-message latency (s), β the transfer time
per byte (s/B) and γ the local reduction time per byte (s/B): the formulas NCCL and HCCL
publish (Thakur, Rabenseifner & Gropp 2005 for ring / halving-doubling / Bruck). Because
every formula is linear in (α, β, γ), fitting them to benchmark rows is a least-squares solve.

Two parameter families per link class, because they differ by an order of magnitude in α:
"native" (the backend's own C++ collectives; the benchmark also fits each native op on its
own, `native:<op>`) and "p2p" (meshspeed's algorithms, which issue one Python-level
send/recv pair per step, all sharing one set). Link classes: "intra" (ranks on one node) and
"inter" (across nodes). `n` is the bytes of the full buffer: the tensor for all_reduce and
broadcast, the output for all_gather, the input for reduce_scatter and all_to_all.
"""

from __future__ import annotations

import json
import math
import os
import platform
from dataclasses import dataclass, field
from itertools import combinations

import torch

from meshspeed.comm.errors import ConfigError

ALGOS: dict[str, tuple[str, ...]] = {
    "all_reduce": ("native", "ring", "hd", "hier"),
    "all_gather": ("native", "ring", "bruck"),
    "reduce_scatter": ("native", "ring", "bruck"),
    "broadcast": ("native",),
    "all_to_all": ("native", "pairwise"),
}
VARS = ("alpha", "beta", "gamma")

# Where the backend's own op moves more bytes than the op needs, and what meshspeed uses
# instead when nothing else is known: gloo's reduce_scatter_tensor is an all-reduce + slice.
WASTEFUL_NATIVE = {("gloo", "reduce_scatter"): "ring"}

# Rough starting points, replaced by `meshspeed bench comm` fits (see save/load).
_DEFAULTS = {
    "gloo": {
        "native.intra": (30e-6, 1 / 2.5e9, 1 / 5e9),
        "native.inter": (60e-6, 1 / 1.0e9, 1 / 5e9),
        "p2p.intra": (60e-6, 1 / 2.5e9, 1 / 5e9),
        "p2p.inter": (120e-6, 1 / 1.0e9, 1 / 5e9),
    },
    "nccl": {
        "native.intra": (8e-6, 1 / 150e9, 1 / 1000e9),
        "native.inter": (15e-6, 1 / 20e9, 1 / 1000e9),
        "p2p.intra": (25e-6, 1 / 100e9, 1 / 1000e9),
        "p2p.inter": (35e-6, 1 / 20e9, 1 / 1000e9),
    },
}


@dataclass
class LinkParams:
    """α, β, γ for each of native.intra, native.inter, p2p.intra, p2p.inter.

    `measured`: what `meshspeed bench comm` timed, per op: a list of {"p", "link", "bytes",
    "us": {algo: time}} rows. When present, an algorithm replaces the backend's own only where
    it measured faster (see choose); the α-β fit then only predicts (planner, overlap chunks).
    `machine`: where the file was measured (a file from another machine or torch is ignored).
    """

    values: dict[str, tuple[float, float, float]]
    source: str = "defaults"
    fitted: dict = field(default_factory=dict)  # fit quality per set, for the record
    measured: dict | None = None
    machine: dict = field(default_factory=dict)
    path: str = ""  # the file these came from ("" for the built-in defaults)
    note: str = ""  # why a saved file was not used, for the one line a run prints

    @classmethod
    def defaults(cls, backend: str) -> LinkParams:
        return cls(dict(_DEFAULTS.get(backend, _DEFAULTS["gloo"])), f"built-in defaults ({backend})")

    def to_dict(self) -> dict:
        return {
            "values": {k: list(v) for k, v in self.values.items()},
            "source": self.source,
            "fitted": self.fitted,
            "measured": self.measured,
            "machine": self.machine,
            "path": self.path,
            "note": self.note,
        }

    @classmethod
    def from_dict(cls, d: dict) -> LinkParams:
        return cls(
            {k: tuple(v) for k, v in d["values"].items()},
            d.get("source", "?"),
            d.get("fitted", {}),
            d.get("measured"),
            d.get("machine") or {},
            d.get("path", ""),
            d.get("note", ""),
        )


def this_machine() -> dict:
    """What must match for a saved measurement to describe this machine: the host, its cores
    and the torch build (a new torch or gloo changes the native collectives' speed)."""
    return {"host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__}


def params_path() -> str:
    return os.environ.get("MESHSPEED_LINK_PARAMS") or os.path.join(
        os.path.expanduser("~"), ".cache", "meshspeed", "link_params.json"
    )


def load(backend: str) -> LinkParams:
    """Fitted parameters for this backend if `bench comm` saved some for this machine, else
    the defaults (with `note` saying why a file that exists was not used)."""
    path = params_path()
    defaults = LinkParams.defaults(backend)
    if path.lower() == "none" or not os.path.exists(path):
        return defaults
    try:
        if os.path.getsize(path) > 16 << 20 or not os.path.isfile(path):
            raise ValueError("not a link-parameter file")
        with open(path) as f:
            entry = json.load(f).get(backend)
        fitted = LinkParams.from_dict(entry) if entry else None
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        defaults.note = f"{path} is not a link-parameter file written by `meshspeed bench comm`; ignored"
        return defaults
    if fitted is None:
        return defaults
    here = this_machine()
    if fitted.measured is None or any(fitted.machine.get(k) != v for k, v in here.items()):
        what = ", ".join(f"{k} {fitted.machine.get(k, '?')}" for k in here) if fitted.machine else "before"
        defaults.note = (
            f"{path} was measured on another machine or torch ({what}; here "
            f"{', '.join(f'{k} {v}' for k, v in here.items())}): ignored, built-in defaults used; "
            "run `meshspeed bench comm` here to measure this machine"
        )
        return defaults
    merged = defaults
    merged.values.update(fitted.values)
    merged.source, merged.fitted, merged.measured = fitted.source, fitted.fitted, fitted.measured
    merged.machine, merged.path = fitted.machine, path
    return merged


def save(backend: str, params: LinkParams, path: str | None = None) -> str:
    path = path or params_path()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    data = {}
    if os.path.exists(path):
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError):
            data = {}
    data[backend] = params.to_dict()
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)
    return path


def parse_algo_env(text: str) -> dict[str, str]:
    """MESHSPEED_ALGO: `ring` (every op that has it) or `all_reduce=hd,all_gather=bruck`."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        op, _, algo = part.rpartition("=")
        op = op or "*"
        if op != "*" and op not in ALGOS:
            raise ConfigError(f"MESHSPEED_ALGO: unknown op {op!r}; valid ops: {', '.join(ALGOS)}")
        valid = sorted({a for o, algos in ALGOS.items() if op in ("*", o) for a in algos})
        if algo not in valid:
            raise ConfigError(
                f"MESHSPEED_ALGO: unknown algorithm {algo!r} for {op}; valid: {', '.join(valid)}"
            )
        out[op] = algo
    return out


def topology(nodes: list[int]) -> tuple[int, int] | None:
    """(number of nodes q, members per node k) if every node holds the same count, else None."""
    counts: dict[int, int] = {}
    for n in nodes:
        counts[n] = counts.get(n, 0) + 1
    ks = set(counts.values())
    return (len(counts), ks.pop()) if len(ks) == 1 else None


def terms(op: str, algo: str, p: int, n: float, nodes: list[int], backend: str) -> dict[str, float]:
    """Coefficients of each `<set>.<class>.<var>` in the predicted time of one call."""
    topo = topology(nodes) or (len(set(nodes)), 1)
    link = link_class(nodes)
    fam = "native" if algo == "native" else "p2p"
    t: dict[str, float] = {}

    def add(cls: str, a=0.0, b=0.0, c=0.0, family=fam):
        for var, coef in zip(VARS, (a, b, c)):
            if coef:
                key = f"{family}.{cls}.{var}"
                t[key] = t.get(key, 0.0) + coef

    if p == 1:
        return t
    frac = (p - 1) / p
    lg = math.ceil(math.log2(p))
    if algo == "native":
        algo = _native_shape(op, backend)
    if algo in ("ring_ar",) or (op == "all_reduce" and algo == "ring"):
        add(link, 2 * (p - 1), 2 * frac * n, frac * n)
    elif algo == "hd":
        p2 = 1 << int(math.log2(p))
        extra = p > p2
        add(
            link,
            2 * int(math.log2(p2)) + 2 * extra,
            2 * (p2 - 1) / p2 * n + 2 * n * extra,
            (p2 - 1) / p2 * n + n * extra,
        )
    elif algo == "hier":
        q, k = topo
        add("intra", 2 * (k - 1), 2 * (k - 1) / k * n, (k - 1) / k * n)
        add("inter", 2 * (q - 1), 2 * (q - 1) / q * n / k, (q - 1) / q * n / k)
    elif algo == "ring":  # all_gather / reduce_scatter
        add(link, p - 1, frac * n, frac * n if op == "reduce_scatter" else 0.0)
    elif algo == "bruck":
        # Bruck moves blocks through local copies the ring avoids (the concatenated sends,
        # the final rotation): charged at γ, the per-byte local-work rate.
        add(link, lg, frac * n, 2 * frac * n if op == "reduce_scatter" else n)
    elif algo == "one_to_all":  # root sends the whole buffer to each peer in turn
        add(link, p - 1, (p - 1) * n)
    elif algo == "pipelined_ring":
        add(link, p - 1, n)
    elif algo == "pairwise":
        add(link, p - 1, frac * n)
    else:
        raise ValueError(f"no cost formula for {op}/{algo}")
    return t


def _native_shape(op: str, backend: str) -> str:
    """Which textbook algorithm the backend's own op behaves like."""
    if op == "all_reduce":
        return "ring_ar"
    if op == "reduce_scatter":
        return "ring_ar" if backend == "gloo" else "ring"
    if op == "broadcast":
        return "one_to_all" if backend == "gloo" else "pipelined_ring"
    if op == "all_to_all":
        return "pairwise"
    return "ring"


def _link(params: LinkParams, fam: str, cls: str, op: str) -> tuple[float, float, float]:
    """Native ops are separate C++ implementations with their own constants, so a per-op fit
    (`native:all_reduce.intra`) wins over the family's when the benchmark produced one."""
    return params.values.get(f"{fam}:{op}.{cls}") or params.values[f"{fam}.{cls}"]


def predict(op: str, algo: str, nbytes: float, nodes: list[int], backend: str, params: LinkParams) -> float:
    """Predicted seconds for one call of `op` with `algo` on a group whose members sit on `nodes`."""
    total = 0.0
    for key, coef in terms(op, algo, len(nodes), nbytes, nodes, backend).items():
        fam, cls, var = key.split(".")
        total += coef * _link(params, fam, cls, op)[VARS.index(var)]
    return total


def candidates(op: str, nodes: list[int], uneven: bool) -> list[str]:
    topo = topology(nodes)
    out = []
    for algo in ALGOS[op]:
        if algo == "native" and uneven:
            continue  # backends need equal chunks
        if algo == "hier" and not (topo and topo[0] > 1 and topo[1] > 1):
            continue  # only pays (and only differs from ring) with several ranks on several nodes
        out.append(algo)
    return out


def choose(
    op: str, nbytes: int, nodes: list[int], backend: str, params: LinkParams, uneven: bool = False
) -> str:
    """The algorithm to run. Deterministic: same inputs on every rank.

    With parameters measured on this machine (`params.measured`), the fastest algorithm
    *measured* for this op, group size and link class at the nearest measured size — never the
    fit's extrapolation, which on a busy machine can make a slower algorithm look faster (issue
    45: a 530 µs α sent tensor parallelism the slow way). Where nothing was measured for this
    group, the built-in defaults decide, as they do without a file: a calibration can only
    replace a choice with one it timed faster."""
    cands = candidates(op, nodes, uneven)
    if params.measured is not None:
        pick = measured_choice(params.measured, op, nbytes, nodes, cands)
        if pick is not None:
            return pick
        params = LinkParams.defaults(backend)
    return min(cands, key=lambda a: (predict(op, a, nbytes, nodes, backend, params), a != "native"))


def link_class(nodes: list[int]) -> str:
    return "inter" if len(set(nodes)) > 1 else "intra"


def measured_choice(measured: dict, op: str, nbytes: int, nodes: list[int], cands: list[str]) -> str | None:
    """The candidate timed fastest at the measured size nearest `nbytes` (log scale) on a group
    of the same size and link class; None where no such row times a candidate."""
    rows = [
        r
        for r in measured.get(op, ())
        if r["p"] == len(nodes) and r["link"] == link_class(nodes) and any(a in r["us"] for a in cands)
    ]
    if not rows:
        return None
    near = min(rows, key=lambda r: (abs(math.log2(r["bytes"]) - math.log2(max(nbytes, 1))), r["bytes"]))
    timed = {a: t for a, t in near["us"].items() if a in cands}
    # ties go to the backend's own op: a replacement must be strictly faster
    return min(timed, key=lambda a: (timed[a], a != "native"))


def _nnls(rows: list[list[float]], target: list[float]) -> list[float]:
    """Non-negative least squares by trying every support set (we have at most six unknowns)."""
    a = torch.tensor(rows, dtype=torch.float64)
    b = torch.tensor(target, dtype=torch.float64)
    nvar = a.shape[1]
    best, best_err = [0.0] * nvar, float(b.pow(2).sum())
    for size in range(1, nvar + 1):
        for support in combinations(range(nvar), size):
            cols = list(support)
            sol = torch.linalg.lstsq(a[:, cols], b.unsqueeze(1)).solution.squeeze(1)
            if (sol < 0).any():
                continue
            err = float((a[:, cols] @ sol - b).pow(2).sum())
            if err < best_err:
                best_err = err
                best = [0.0] * nvar
                for c, v in zip(cols, sol.tolist()):
                    best[c] = v
    return best


def fit(rows: list[dict], nodes: list[int], backend: str, base: LinkParams | None = None) -> LinkParams:
    """Fit α, β, γ to measured rows ({op, algo, bytes, time_us}) on a group laid out as `nodes`.

    Minimises the relative error so that small messages (latency-bound) weigh as much as large
    ones. Parameter sets with no informative row keep their previous values.
    """
    params = LinkParams(dict((base or LinkParams.defaults(backend)).values), "fitted")
    native_ops = sorted({r["op"] for r in rows if r["algo"] == "native"})
    sets = [("p2p", None)] + [("native", op) for op in native_ops]
    for fam, only_op in sets:
        sel = [
            r
            for r in rows
            if (r["algo"] == "native") == (fam == "native")
            and r["time_us"] > 0
            and (only_op is None or r["op"] == only_op)
        ]
        if not sel:
            continue
        coefs = [terms(r["op"], r["algo"], len(nodes), r["bytes"], nodes, backend) for r in sel]
        if only_op is not None:
            # One op alone cannot tell β from γ (both scale with n in every row): fit an
            # effective β that includes the reduction, and zero γ for this per-op set.
            coefs = [{k: v for k, v in c.items() if not k.endswith(".gamma")} for c in coefs]
        keys = sorted({k for c in coefs for k in c})
        # Scale columns to O(1) so lstsq is well conditioned (α ~ 1e-5 s, β ~ 1e-10 s/B).
        scale = {k: max(abs(c.get(k, 0.0)) for c in coefs) or 1.0 for k in keys}
        a = [[c.get(k, 0.0) / scale[k] / (r["time_us"] * 1e-6) for k in keys] for c, r in zip(coefs, sel)]
        sol = _nnls(a, [1.0] * len(sel))
        name = fam if only_op is None else f"{fam}:{only_op}"
        for k, v in zip(keys, sol):
            f, cls, var = k.split(".")
            cur = list(params.values.get(f"{name}.{cls}") or params.values[f"{f}.{cls}"])
            if only_op is not None:
                cur[VARS.index("gamma")] = 0.0
            cur[VARS.index(var)] = v / scale[k]
            params.values[f"{name}.{cls}"] = tuple(cur)
        preds = [predict(r["op"], r["algo"], r["bytes"], nodes, backend, params) * 1e6 for r in sel]
        errs = sorted(abs(pr - r["time_us"]) / r["time_us"] for pr, r in zip(preds, sel))
        params.fitted[name] = {"rows": len(sel), "median_rel_err": errs[len(errs) // 2]}
    return params
