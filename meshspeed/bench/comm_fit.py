"""What `meshspeed bench comm` keeps of its measurement: the α-β fit (for predictions), the
measured time of every algorithm per op and size (which decides what runs; see
cost_model.choose), the fit's error per op, the choices later runs will make, and the plot."""

from __future__ import annotations

import statistics
import time

from meshspeed import comm
from meshspeed.comm import cost_model


def fmt_size(n: int) -> str:
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def measured_table(rows: list[dict], nodes: list[int]) -> dict:
    """Per op, per size: the time of each algorithm meshspeed ran (the backend's own op as
    "native": meshspeed's native path where it was timed, else the raw call). Noisy sizes are
    left out: the nearest quiet size decides there."""
    by_size: dict[tuple[str, int], dict[str, float]] = {}
    raw: dict[tuple[str, int], float] = {}
    for r in rows:
        if r["noisy"] or r["op"] == "broadcast":
            continue
        key = (r["op"], r["bytes"])
        raw[key] = r["raw_time_us"]
        us = by_size.setdefault(key, {})
        us[r["resolved"]] = min(us.get(r["resolved"], float("inf")), r["time_us"])
    out: dict[str, list] = {}
    for (op, nbytes), us in sorted(by_size.items()):
        us.setdefault("native", raw[(op, nbytes)])
        row = {"p": len(nodes), "link": cost_model.link_class(nodes), "bytes": nbytes, "us": us}
        out.setdefault(op, []).append(row)
    return out


def fit_and_predict(rows: list[dict], ctx) -> cost_model.LinkParams:
    """Fit α-β-γ to the rows that were not noisy (auto rows count as the algorithm they
    resolved to, raw rows as "native"), keep the measured times per size (they, not the fit,
    decide which algorithm runs), and annotate each row with the fit's prediction."""
    nodes = ctx.world.nodes
    quiet = [r for r in rows if not r["noisy"]]
    fit_rows = [
        {"op": r["op"], "algo": r["resolved"], "bytes": r["bytes"], "time_us": r["time_us"]} for r in quiet
    ]
    fit_rows += [
        {"op": r["op"], "algo": "native", "bytes": r["bytes"], "time_us": r["raw_time_us"]}
        for r in quiet
        if r["algo"] == "auto"
    ]
    params = cost_model.fit(fit_rows, nodes, ctx.backend, ctx.link_params)
    params.source = f"meshspeed bench comm, {ctx.world_size} ranks, {time.strftime('%Y-%m-%d %H:%M')}"
    params.measured = measured_table(rows, nodes)
    params.machine = cost_model.this_machine()
    for r in rows:
        r["predicted_us"] = (
            cost_model.predict(r["op"], r["resolved"], r["bytes"], nodes, ctx.backend, params) * 1e6
        )
    return params


def fit_errors(rows: list[dict]) -> dict[str, float]:
    """Per op: the median |predicted − measured| / measured of the fit over its quiet rows."""
    errs: dict[str, list[float]] = {}
    for r in rows:
        if "predicted_us" in r and not r["noisy"]:
            errs.setdefault(r["op"], []).append(abs(r["predicted_us"] - r["time_us"]) / r["time_us"])
    return {op: statistics.median(e) for op, e in errs.items()}


def choices(params: cost_model.LinkParams, rows: list[dict], nodes: list[int], backend: str) -> list[str]:
    """Per op: which algorithm the saved file makes runs use, by size range."""
    out = []
    for op in dict.fromkeys(r["op"] for r in rows):
        if op == "broadcast":
            continue
        picks = []
        for nbytes in sorted({r["bytes"] for r in rows if r["op"] == op}):
            algo = cost_model.choose(op, nbytes, nodes, backend, params)
            if picks and picks[-1][1] == algo:
                picks[-1][0][1] = nbytes
            else:
                picks.append([[nbytes, nbytes], algo])
        text = ", ".join(f"{fmt_size(lo)}–{fmt_size(hi)} {a}" for (lo, hi), a in picks)
        out.append(f"#   {op:<15} {text}")
    return out


def plot(rows: list[dict], path: str, p: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise comm.ConfigError("--plot needs matplotlib: pip install matplotlib") from None
    fig, ax = plt.subplots(figsize=(9, 5.5))
    series: dict[tuple, dict[int, float]] = {}
    for r in rows:
        series.setdefault((r["op"], r["algo"]), {})[r["bytes"]] = r["busbw_gbps"]
        series.setdefault((r["op"], "raw torch"), {})[r["bytes"]] = r["raw_busbw_gbps"]
    ops = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
    colors = dict(zip(ops, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")))
    # Colour = op; line style and marker = algorithm; the raw torch call is a thick dotted line.
    styles = {
        "raw torch": (":", "x"),
        "auto": ("-", "o"),
        "native": ("--", "."),
        "ring": ("-.", "^"),
        "hd": ((0, (5, 1)), "v"),
        "hier": ((0, (3, 1, 1, 1)), "D"),
        "bruck": ((0, (1, 2)), "s"),
        "pairwise": ((0, (3, 3)), "p"),
    }
    for (op, algo), points in sorted(series.items()):
        xs = sorted(points)
        ls, marker = styles.get(algo, ("-", "o"))
        ax.plot(
            xs,
            [points[x] for x in xs],
            color=colors.get(op, "k"),
            linestyle=ls,
            marker=marker,
            markersize=4,
            linewidth=2.5 if algo == "raw torch" else 1.3,
            label=f"{op} / {algo}",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")  # small messages are latency-bound: a linear axis would flatten them to 0
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"meshspeed bench comm — {p} ranks")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
