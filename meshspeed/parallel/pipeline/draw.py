"""Render a simulated schedule: ASCII timeline for the terminal, PNG timeline, JSON.

All three take a SimResult (simulate.py) so what is drawn is exactly what was simulated.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction

from meshspeed.parallel.pipeline.actions import B, F, W
from meshspeed.parallel.pipeline.simulate import SimResult

_KIND_NAMES = {F: "forward", B: "backward", W: "weight grad"}


def ascii_timeline(result: SimResult, width: int = 120) -> str:
    """One line per rank (per rank and chunk when vpp > 1); a box starts with its label
    (kind + microbatch), '.' is idle, ' ' on a chunk line means the rank is busy with another chunk.

    Columns per time unit are chosen so the shortest box gets a whole number of columns (up to
    its label length) within `width`; labels that do not fit are cut, and the per-rank action
    list printed beside the timeline is the exact record."""
    spans = [s for tl in result.timelines for s in tl if s.end > s.start]
    if not spans:
        return "(empty schedule)"
    makespan = float(result.makespan)
    shortest = min(float(s.end - s.start) for s in spans)
    longest_label = max(len(f"{s.action.kind}{s.action.microbatch}") for s in spans)
    per_box = min(longest_label + 1, math.floor(width * shortest / makespan))
    scale = per_box / shortest if per_box >= 1 else width / makespan  # columns per time unit
    cols = max(1, math.ceil(makespan * scale - 1e-9))
    vpp = result.vpp
    names = [f"rank {r}" + (f" c{c}" if vpp > 1 else "") for r in range(result.pp) for c in range(vpp)]
    prefix = max(len(n) for n in names) + 2
    lines = [" " * prefix + _ruler(makespan, scale, cols)]
    for rank, timeline in enumerate(result.timelines):
        busy = [False] * cols
        rows = [["."] * cols for _ in range(vpp)]
        for start, end, action in timeline:
            c0 = min(cols - 1, round(float(start) * scale))
            c1 = min(cols, max(c0 + 1, round(float(end) * scale)))
            busy[c0:c1] = [True] * (c1 - c0)
            text = f"{action.kind}{action.microbatch}"[: c1 - c0].ljust(c1 - c0)
            rows[action.chunk][c0:c1] = list(text)
        for chunk, row in enumerate(rows):
            if vpp > 1:  # busy on another chunk: blank, so '.' still means the rank is idle
                row = [" " if ch == "." and busy[i] else ch for i, ch in enumerate(row)]
            label = f"rank {rank}" + (f" c{chunk}" if vpp > 1 else "") if chunk == 0 else f"c{chunk}"
            lines.append(f"{label}: ".rjust(prefix) + "".join(row))
    lines.append(
        " "
        * prefix
        + f"F=forward B=backward{' W=weight-grad' if result.split else ''}, then the microbatch; "
        f"{'c<k> = model chunk k; ' if vpp > 1 else ''}'.' = idle; 1 column = {1 / scale:.3g} time units"
    )
    return "\n".join(lines)


def _ruler(makespan: float, scale: float, cols: int) -> str:
    """Tick labels at a round time step, spaced so they do not collide."""
    step = 1.0
    while step * scale < 6:
        step *= 2 if str(step)[0] == "1" else 2.5
    ruler = [" "] * (cols + 8)
    t = 0.0
    while t <= makespan + 1e-9:
        c = round(t * scale)
        text = f"|{t:g}"
        ruler[c : c + len(text)] = list(text)
        t += step
    return "".join(ruler).rstrip()


def to_json(result: SimResult, indent: int | None = 2) -> str:
    """Schedule (with communication) plus simulated timeline; times as floats, bubbles also exact."""

    def num(x):
        return float(x) if isinstance(x, Fraction) else x

    def exact(x):
        return str(x) if isinstance(x, Fraction) else repr(x)

    c = result.costs
    doc = {
        "schedule": result.name,
        "pp": result.pp,
        "vpp": result.vpp,
        "microbatches": result.microbatches,
        "split_backward": result.split,
        "costs": {"f": num(c.f), "b": num(c.b), "w": num(c.w), "p2p": num(c.p2p)},
        "makespan": num(result.makespan),
        "bubble": num(result.bubble),
        "bubble_exact": exact(result.bubble),
        "bubble_per_rank": [num(b) for b in result.bubble_per_rank],
        "peak_activations": result.peak_activations,
        "actions": [[str(a) for a in acts] for acts in result.schedule],
        "timeline": [[[num(s.start), num(s.end), str(s.action)] for s in tl] for tl in result.timelines],
    }
    return json.dumps(doc, indent=indent)


# Base colours per kind; chunk k of vpp is drawn lighter (blended towards white) so the chunk
# reads at a glance while the kind stays obvious.
_COLOURS = {F: (0.16, 0.42, 0.75), B: (0.18, 0.60, 0.30), W: (0.85, 0.50, 0.10)}


def _shade(kind: str, chunk: int, vpp: int) -> tuple[float, float, float]:
    base = _COLOURS[kind]
    t = 0.55 * chunk / max(1, vpp - 1) if vpp > 1 else 0.0
    return tuple(c + (1 - c) * t for c in base)


def draw_png(
    result: SimResult, path: str, title: str | None = None, xlabel: str = "time (cost units)"
) -> str:
    """Write a timeline PNG (one row per rank, time across). Returns the path."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; never needs a display
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise RuntimeError("matplotlib is needed for --png; pip install matplotlib") from None

    pp, vpp = result.pp, result.vpp
    makespan = float(result.makespan) or 1.0
    shortest = min(
        (float(s.end - s.start) for tl in result.timelines for s in tl if s.end > s.start), default=1.0
    )
    # Wide enough that the shortest box holds a 2-3 character label, capped to stay viewable.
    fig_w = min(30.0, max(10.0, 0.32 * makespan / shortest + 1.5))
    fig_h = 1.2 + 0.55 * pp
    fig, ax = plt.subplots(figsize=(fig_w, fig_h), dpi=110)
    axis_w_in = fig_w * 0.86
    for rank, timeline in enumerate(result.timelines):
        for start, end, action in timeline:
            s, e = float(start), float(end)
            colour = _shade(action.kind, action.chunk, vpp)
            ax.barh(rank, e - s, left=s, height=0.8, color=colour, edgecolor="white", linewidth=0.8)
            box_in = (e - s) / makespan * axis_w_in
            text = f"{action.microbatch}.{action.chunk}" if vpp > 1 else str(action.microbatch)
            size = min(9.0, box_in * 72 / (0.62 * len(text) + 0.4))
            if size < 5.0 and vpp > 1:
                text = str(action.microbatch)
                size = min(9.0, box_in * 72 / (0.62 * len(text) + 0.4))
            if size >= 4.5:
                light = sum(colour) / 3 > 0.6
                ax.text(
                    (s + e) / 2,
                    rank,
                    text,
                    ha="center",
                    va="center",
                    fontsize=size,
                    color="black" if light else "white",
                )
    ax.set_ylim(pp - 0.5, -0.5)
    ax.set_yticks(range(pp))
    ax.set_yticklabels([f"rank {r}" for r in range(pp)])
    ax.set_xlim(0, makespan)
    ax.set_xlabel(xlabel)
    ax.grid(axis="x", color="0.9", linewidth=0.5)
    ax.set_axisbelow(True)
    kinds = [F, B] + ([W] if result.split else [])
    handles = [
        Patch(
            color=_shade(k, c, vpp),
            label=f"{k} {'input grad' if k == B and result.split else _KIND_NAMES[k]}"
            + (f" chunk {c}" if vpp > 1 else ""),
        )
        for k in kinds
        for c in range(vpp)
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    bubble = result.bubble
    bubble_text = (
        f"{bubble.numerator}/{bubble.denominator} ({float(bubble):.3f})"
        if isinstance(bubble, Fraction)
        else f"{bubble:.3f}"
    )
    ax.set_title(
        title
        or f"{result.name or 'schedule'}   pp={pp}  vpp={vpp}  m={result.microbatches}   "
        f"bubble={bubble_text}   makespan={float(result.makespan):g}",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
