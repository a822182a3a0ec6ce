"""validate(): is a schedule complete, ordered within each rank, and free of deadlock?

Three checks, cheapest first, each failing with one line that names the rank and the action:
1. completeness: every (microbatch, chunk) on every rank has exactly one F and one B, plus one W
   when the backward is split (any W anywhere means split);
2. order within a rank: F before B of the same (microbatch, chunk), B before W;
3. deadlock freedom: the schedule (communication inserted if absent) runs to the end in the
   event simulation with non-blocking sends and blocking receives; the simulation also catches
   receives out of send order on a pair of ranks and sends to the wrong peer. `placement` is
   the schedule's (actions.py): which rank holds which stage decides who sends to whom.
"""

from __future__ import annotations

from collections import Counter

from meshspeed.parallel.pipeline.actions import Action, B, F, ScheduleError, W
from meshspeed.parallel.pipeline.simulate import Costs, SimResult, simulate

_NAMES = {F: "forward", B: "backward", W: "weight-gradient"}


def validate(
    schedule: list[list[Action]],
    pp: int,
    vpp: int,
    microbatches: int,
    split: bool | None = None,
    placement: str = "loop",
) -> SimResult:
    """Raise ScheduleError (DeadlockError for cycles) if `schedule` is not runnable; else return
    its unit-cost simulation."""
    if len(schedule) != pp:
        raise ScheduleError(f"schedule has {len(schedule)} ranks but pp={pp}; give one action list per rank")
    if split is None:
        split = any(a.kind == W for acts in schedule for a in acts)
    kinds = (F, B, W) if split else (F, B)
    for rank, acts in enumerate(schedule):
        compute = [a for a in acts if a.is_compute]
        for a in compute:
            if not 0 <= a.chunk < vpp:
                raise ScheduleError(
                    f"rank {rank}: {a} uses chunk {a.chunk} but vpp={vpp} (chunks 0..{vpp - 1})"
                )
            if not 0 <= a.microbatch < microbatches:
                raise ScheduleError(
                    f"rank {rank}: {a} uses microbatch {a.microbatch} but microbatches={microbatches} "
                    f"(0..{microbatches - 1})"
                )
            if a.kind == W and not split:
                raise ScheduleError(
                    f"rank {rank}: {a} is a W but split=False; a non-split schedule has full backwards only"
                )
        seen = Counter((a.kind, a.microbatch, a.chunk) for a in compute)
        for (kind, mb, chunk), n in seen.items():
            if n > 1:
                raise ScheduleError(
                    f"rank {rank} runs {kind}{mb}.{chunk} {n} times; each must run exactly once"
                )
        for mb in range(microbatches):
            for chunk in range(vpp):
                for kind in kinds:
                    if (kind, mb, chunk) not in seen:
                        raise ScheduleError(
                            f"rank {rank} has no {kind}{mb}.{chunk} ({_NAMES[kind]} of microbatch {mb}, "
                            f"chunk {chunk}); "
                            f"every microbatch needs {'/'.join(kinds)} on every chunk"
                        )
        position = {(a.kind, a.microbatch, a.chunk): i for i, a in enumerate(compute)}
        for (kind, mb, chunk), i in position.items():
            before = {B: F, W: B}.get(kind)
            if before and position[(before, mb, chunk)] > i:
                raise ScheduleError(
                    f"rank {rank}: {kind}{mb}.{chunk} comes before {before}{mb}.{chunk}; "
                    f"the {_NAMES[kind]} of a microbatch needs its {_NAMES[before]} first"
                )
    return simulate(schedule, pp, vpp, Costs(), split=split, placement=placement)
