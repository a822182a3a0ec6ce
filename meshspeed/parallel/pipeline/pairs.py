"""Which adjacent forward/backward actions a runtime may run as one overlapped step, and the
order it then executes: pure data, checked by the same simulation as every schedule.

A candidate is a forward F followed (among compute actions) by a backward B on the same rank
that does not depend on it (fb_overlap's rule: B of micro-batch j at stage s needs the F of j
at every stage >= s). To run them together the rank needs both inputs first and sends F's
output only after the pair, so its executed order moves every receive between F and B to
before F, and F's sends to right after B (before B's own sends: each channel keeps its send
order, so the receivers' order-matched receives are unchanged).

Receiving B's gradient before F can cost time (1F1B's steady state gets it just in time, after
its F) or even create a cycle (the peer needs this rank's F output to produce that gradient).
So a candidate is kept only where, in the schedule's own unit-cost simulation, B's gradient has
arrived by the time F starts and F's output is not needed before B ends: then that timeline is
still feasible for the executed order, which therefore runs (no cycle) in exactly the same
time; the overlap hides exchanges for free and the bubble stays the schedule's. DualPipeV keeps
all its steady pairs but the last rank's first one (which its authors leave apart too); 1F1B
keeps none (each gradient arrives just after the forward before it).
"""

from __future__ import annotations

from meshspeed.parallel.pipeline.actions import RECV_B, RECV_F, SEND_F, Action, B, F, holder_of, stage_of
from meshspeed.parallel.pipeline.simulate import simulate


def candidates(schedule: list[list[Action]], pp: int, placement: str = "loop") -> list[tuple[int, int, int]]:
    """(rank, index of F, index of B) in the schedule (with comms) for every adjacent
    independent F -> B compute pair."""
    out = []
    for rank, acts in enumerate(schedule):
        compute = [i for i, a in enumerate(acts) if a.is_compute]
        for i, j in zip(compute, compute[1:]):
            f, b = acts[i], acts[j]
            if f.kind != F or b.kind != B:
                continue
            if f.microbatch == b.microbatch and stage_of(rank, f.chunk, pp, placement) >= stage_of(
                rank, b.chunk, pp, placement
            ):
                continue
            out.append((rank, i, j))
    return out


def _reorder(acts: list[Action], chosen: set[tuple[int, int]]) -> tuple[list[Action], list[int]]:
    """acts with each chosen (i, j) pair made adjacent; returns (executed, F positions)."""
    out: list[Action] = []
    starts: list[int] = []
    skip: set[int] = set()
    for i, a in enumerate(acts):
        if i in skip:
            continue
        j = next((j for (fi, j) in chosen if fi == i), None)
        if j is None:
            out.append(a)
            continue
        between = acts[i + 1 : j]
        sends = [x for x in between if x.kind == SEND_F]
        recvs = [x for x in between if x.kind in (RECV_F, RECV_B)]
        if len(sends) + len(recvs) != len(between):
            raise AssertionError(f"unexpected actions between {a} and {acts[j]}: {between}")
        starts.append(len(out) + len(recvs))
        out += recvs + [a] + sends + [acts[j]]
        skip.update(range(i + 1, j + 1))
    return out, starts


def _execute(schedule, chosen_by_rank):
    executed, starts = [], []
    for rank, acts in enumerate(schedule):
        e, s = _reorder(acts, chosen_by_rank[rank])
        executed.append(e)
        starts.append(s)
    return executed, starts


def overlapped(
    schedule: list[list[Action]], pp: int, vpp: int, placement: str = "loop", split: bool = False
) -> tuple[list[list[Action]], list[list[int]]]:
    """(executed schedule, per rank the positions in it of each overlapped pair's F; its B is
    the next action). `schedule` carries its communication (build_schedule)."""
    base = simulate(schedule, pp, vpp, split=split, placement=placement)
    span = {(r, s.action): s for r, tl in enumerate(base.timelines) for s in tl}
    p2p = base.costs.p2p
    chosen: list[set] = [set() for _ in range(pp)]
    for rank, i, j in candidates(schedule, pp, placement):
        f, b = schedule[rank][i], schedule[rank][j]
        stage = stage_of(rank, b.chunk, pp, placement)
        ok = True
        if stage < pp * vpp - 1:  # B's gradient comes from the next stage
            src, chunk = holder_of(stage + 1, pp, placement)
            if src != rank:
                ok = span[(src, Action(B, b.microbatch, chunk))].end + p2p <= span[(rank, f)].start
        if ok:
            chosen[rank].add((i, j))
    executed, starts = _execute(schedule, chosen)
    got = simulate(executed, pp, vpp, split=split, placement=placement).makespan
    if got != base.makespan:  # cannot happen (the module docstring's argument); say so if it does
        raise AssertionError(f"overlapped pairs changed the simulated step: {got} vs {base.makespan}")
    return executed, starts
