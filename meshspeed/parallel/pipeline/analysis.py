"""Closed forms to check simulations against, and the F|B overlap count of a schedule."""

from __future__ import annotations

from fractions import Fraction

from meshspeed.parallel.pipeline.actions import Action, B, F, stage_of
from meshspeed.parallel.pipeline.simulate import Costs


def closed_form(name: str, pp: int, vpp: int, m: int, costs: Costs) -> tuple[Fraction, str] | None:
    """(bubble fraction, formula) where a closed form is known to equal the simulation exactly.

    All assume p2p = 0. With this module's cost convention (a chunk costs 1/vpp of a rank's work):
    - gpipe, 1f1b: (p-1)/(m+p-1) for any f, b, w: fill and drain each cost (p-1)(f+b+w).
    - interleaved (both variants): (p-1)/(v*m+p-1) for any f, b, w: fill/drain shrink by v.
    - zero-bubble (ZB-H1): (p-1)/(3m+p-1) when f = b = w and m >= p; the ZB paper's
      (p-1)(f+b-w) bubble. For other cost ratios the simulation is the answer.
    - dualpipev: (p-1)/(6m+p-1) when f = b = w (m >= 2p by construction): every rank idles
      (p-1)·f/2, half of ZB-H1's (p-1)·f, because each rank's two chunks fill each other's
      fill and drain. Uneven costs move the critical path between phases (the simulation is
      the answer there).
    None elsewhere (p2p > 0, uneven zero-bubble / dualpipev costs).
    """
    if costs.p2p != 0:
        return None
    p = pp
    if name in ("gpipe", "1f1b"):
        return Fraction(p - 1, m + p - 1), "(p-1)/(m+p-1)"
    if name.startswith("interleaved"):
        return Fraction(p - 1, vpp * m + p - 1), "(p-1)/(v*m+p-1)"
    if name == "zero-bubble" and costs.f == costs.b == costs.w and m >= p:
        return Fraction(p - 1, 3 * m + p - 1), "(p-1)/(3m+p-1)"
    if name == "dualpipev" and costs.f == costs.b == costs.w:
        return Fraction(p - 1, 6 * m + p - 1), "(p-1)/(6m+p-1)"
    return None


def fb_overlap(schedule: list[list[Action]], pp: int, placement: str = "loop") -> tuple[int, int]:
    """(independent, total) over adjacent F-then-B compute pairs on each rank.

    A pair is independent when the B does not need that F, even through other ranks: B of
    (mb, stage s) needs F of (mb, every stage >= s). An independent pair can run its F and B
    concurrently so one's communication (p2p, MoE all-to-all) hides behind the other's compute;
    that is what the extra warmup microbatch of 'interleaved-extra-warmup' buys."""
    independent = total = 0
    for rank, acts in enumerate(schedule):
        compute = [a for a in acts if a.is_compute]
        for a, b in zip(compute, compute[1:]):
            if a.kind == F and b.kind == B:
                total += 1
                dependent = a.microbatch == b.microbatch and stage_of(
                    rank, a.chunk, pp, placement
                ) >= stage_of(rank, b.chunk, pp, placement)
                independent += not dependent
    return independent, total


def evaluate(name: str, pp: int, vpp: int, microbatches: int, costs: Costs | None = None):
    """Build the named schedule, validate it, and simulate it with `costs`: the one call the CLI
    and planners need. Returns a SimResult with `name` set."""
    # imported here: schedules -> comms -> actions is the only chain analysis needs at import time
    from meshspeed.parallel.pipeline.schedules import build_schedule, get_schedule
    from meshspeed.parallel.pipeline.simulate import simulate
    from meshspeed.parallel.pipeline.validate import validate

    fn = get_schedule(name)
    split, placement = fn.split_backward, fn.placement
    schedule = build_schedule(name, pp, vpp, microbatches)
    validate(schedule, pp, vpp, microbatches, split=split, placement=placement)
    result = simulate(schedule, pp, vpp, costs or Costs(), split=split, placement=placement)
    result.name = name
    result.microbatches = microbatches
    return result
