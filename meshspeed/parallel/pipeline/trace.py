"""A real run's pipeline timeline, in the simulator's terms, next to the simulated one.

The runtime records (start, end) of every action of one step on every rank (one clock origin
after a barrier). `measured_result` turns that into a SimResult (compute spans only; waits
on receives and Python overhead are the gaps), so draw.py draws and to_json writes it like a
simulated one; `measured_costs` averages the per-action times into simulator Costs (p2p: the
median delivery time of messages a receiver waited for, `p2p_latency`), and `compare`
simulates the same schedule with them: the bubble the schedule and the measured costs
explain versus the one measured.
"""

from __future__ import annotations

import json
import os
from statistics import mean, median

from meshspeed.parallel.pipeline.actions import RECV_B, RECV_F, SEND_B, SEND_F, Action, B, F, W
from meshspeed.parallel.pipeline.schedules import SCHEDULES
from meshspeed.parallel.pipeline.simulate import Costs, SimResult, Span, peak_activations, simulate


def measured_result(
    name: str,
    schedule: list[list[Action]],
    times: list[list[tuple[float, float]]],
    pp: int,
    vpp: int,
    microbatches: int,
    split: bool,
) -> SimResult:
    """SimResult of a recorded step. times[rank][i] = (start, end) of schedule[rank][i], seconds.
    An overlapped F/B pair (duet.py) is one span split at the time its forward side ran."""
    origin = min(t[0][0] for t in times if t)
    timelines, busy = [], []
    for acts, ts in zip(schedule, times):
        spans = [Span(s - origin, e - origin, a) for a, (s, e) in zip(acts, ts) if a.is_compute]
        timelines.append(spans)
        busy.append(sum(s.end - s.start for s in spans))
    makespan = max((t[-1][1] - origin for t in times if t), default=0.0)
    costs = measured_costs(timelines, vpp, split, p2p_latency(schedule, times))
    result = SimResult(
        pp=pp,
        vpp=vpp,
        costs=costs,
        split=split,
        schedule=schedule,
        timelines=timelines,
        makespan=makespan,
        busy=busy,
        peak_activations=[peak_activations(a, split) for a in schedule],
        microbatches=microbatches,
        name=name,
        placement=SCHEDULES[name].placement if name in SCHEDULES else "loop",
    )
    return result


def measured_costs(timelines: list[list[Span]], vpp: int, split: bool, p2p: float = 0.0) -> Costs:
    """Mean F / B / W time over all ranks, scaled to a rank's whole share (simulate.py's
    convention: with vpp chunks a chunk costs 1/vpp). Without a split, B is the whole
    backward: Costs(b=B, w=0)."""
    per = {k: [s.end - s.start for tl in timelines for s in tl if s.action.kind == k] for k in (F, B, W)}
    f, b = (mean(per[k]) * vpp if per[k] else 0.0 for k in (F, B))
    w = mean(per[W]) * vpp if split and per[W] else 0.0
    return Costs(f=f, b=b, w=w, p2p=p2p)


def p2p_latency(
    schedule: list[list[Action]], times: list[list[tuple[float, float]]], min_wait: float = 1e-4
) -> float:
    """Median delivery time of the messages a receiver actually waited for: end of its RECV
    minus the start of the matching SEND (the k-th send on a rank pair meets the k-th
    receive, comms.py). A receive that found its message already there bounds nothing and
    is skipped; 0.0 when no receive waited."""
    sends: dict[tuple[int, int], list[float]] = {}
    for rank, (acts, ts) in enumerate(zip(schedule, times)):
        for a, (start, _) in zip(acts, ts):
            if a.kind in (SEND_F, SEND_B):
                sends.setdefault((rank, a.peer), []).append(start)
    samples, seen = [], {}
    for rank, (acts, ts) in enumerate(zip(schedule, times)):
        for a, (start, end) in zip(acts, ts):
            if a.kind not in (RECV_F, RECV_B):
                continue
            k = seen[(a.peer, rank)] = seen.get((a.peer, rank), -1) + 1
            if end - start >= min_wait:
                # Ranks share a clock origin only up to how far apart they left the barrier
                # (a scheduling quantum on a busy host), so a delivery can appear to end
                # before its send began: that sample says "about zero", not negative time.
                samples.append(max(0.0, end - sends[(a.peer, rank)][k]))
    return median(samples) if samples else 0.0


def compare(measured: SimResult) -> SimResult:
    """The same schedule simulated with the measured mean costs."""
    sim = simulate(
        measured.schedule,
        measured.pp,
        measured.vpp,
        measured.costs,
        split=measured.split,
        placement=measured.placement,
    )
    sim.name, sim.microbatches = measured.name, measured.microbatches
    return sim


def write_trace(directory: str, measured: SimResult, step: int, png: bool = True) -> dict:
    """pp_trace.json (measured and simulated timelines, costs, bubbles) and, with matplotlib,
    pp_trace.png / pp_trace_sim.png drawn by draw.py. Returns {"json": path, "png": [...]}."""
    from meshspeed.parallel.pipeline.draw import draw_png, to_json

    sim = compare(measured)
    os.makedirs(directory, exist_ok=True)
    doc = {
        "step": step,
        "unit": "seconds",
        "measured": json.loads(to_json(measured)),
        "simulated": json.loads(to_json(sim)),
        "bubble_measured": float(measured.bubble),
        "bubble_simulated": float(sim.bubble),
        "makespan_measured": float(measured.makespan),
        "makespan_simulated": float(sim.makespan),
    }
    path = os.path.join(directory, "pp_trace.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    out = {"json": path, "png": []}
    if png:
        try:
            for res, stem, what in ((measured, "pp_trace", "measured"), (sim, "pp_trace_sim", "simulated")):
                title = (
                    f"{what}: {res.name}  pp={res.pp} vpp={res.vpp} m={res.microbatches}  "
                    f"bubble={float(res.bubble):.3f}  makespan={float(res.makespan) * 1e3:.1f} ms"
                )
                out["png"].append(
                    draw_png(res, os.path.join(directory, f"{stem}.png"), title=title, xlabel="time (s)")
                )
        except RuntimeError:  # no matplotlib: the JSON is the record
            pass
    return out
