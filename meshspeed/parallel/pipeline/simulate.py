"""Run a schedule through an event simulation: timelines, makespan, bubble, peak activations.

Cost convention (what the numbers mean):
- `f`, `b`, `w` are the times of one microbatch through ONE RANK'S WHOLE SHARE of the model.
  With vpp chunks per rank each chunk costs f/vpp, b/vpp, w/vpp, so schedules with different
  vpp are compared on the same model and the same pp.
- `b` is the input-gradient part of the backward and `w` the weight-gradient part. A schedule that
  does not split the backward runs one B costing b + w.
- `p2p` is the latency of one SEND->RECV message; sends are asynchronous (cost the sender
  nothing), receives block until the message has arrived.
Default unit costs f = b = w = 1 (full backward = 2 forwards, the usual rule of thumb) with p2p = 0
make 1F1B's bubble exactly (pp-1)/(m+pp-1): 3/11 at pp 4, m 8.

Numbers may be ints, Fractions or floats; ints/Fractions give exact Fraction results.

Peak in-flight activations: per rank, the most (microbatch, chunk) pairs whose F has run and whose
LAST backward piece has not (B, or W for split schedules). W still reads the saved layer inputs,
so counting until W is the conservative figure for zero-bubble.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple

from meshspeed.parallel.pipeline.actions import (
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    ScheduleError,
    W,
    check_placement,
    holder_of,
    stage_of,
)
from meshspeed.parallel.pipeline.comms import has_comms, insert_comms, message_of

Number = int | float | Fraction


class DeadlockError(ScheduleError):
    """No rank can take its next step: each is blocked on a receive nobody will send."""


@dataclass(frozen=True)
class Costs:
    f: Number = 1
    b: Number = 1
    w: Number = 1
    p2p: Number = 0

    def __post_init__(self) -> None:
        for key in ("f", "b", "w", "p2p"):
            if getattr(self, key) < 0:
                raise ScheduleError(f"cost {key}={getattr(self, key)} is negative; costs are times >= 0")

    def of(self, action: Action, vpp: int, split: bool) -> Number:
        full = {F: self.f, B: self.b if split else self.b + self.w, W: self.w}[action.kind]
        return Fraction(full, vpp) if isinstance(full, (int, Fraction)) else full / vpp


class Span(NamedTuple):
    start: Number
    end: Number
    action: Action


@dataclass
class SimResult:
    pp: int
    vpp: int
    costs: Costs
    split: bool
    schedule: list[list[Action]]  # with communication actions
    timelines: list[list[Span]]  # compute actions only, per rank, in time order
    makespan: Number
    busy: list[Number]
    peak_activations: list[int]
    microbatches: int = 0
    name: str = ""  # set by analysis.evaluate; used in titles and JSON
    placement: str = "loop"  # who holds which stage (actions.py)

    @property
    def idle(self) -> list[Number]:
        return [self.makespan - b for b in self.busy]

    @property
    def bubble_per_rank(self) -> list[Number]:
        return [_div(i, self.makespan) for i in self.idle]

    @property
    def bubble(self) -> Number:
        """Idle time over all ranks / (pp * makespan)."""
        return _div(sum(self.idle), self.pp * self.makespan)


def _div(a: Number, b: Number) -> Number:
    if b == 0:
        return 0
    if isinstance(a, (int, Fraction)) and isinstance(b, (int, Fraction)):
        return Fraction(a) / Fraction(b)
    return a / b


def _producer(action: Action, rank: int, pp: int, vpp: int, placement: str) -> tuple[str, int, int] | None:
    """(kind, rank, chunk) of the compute whose output `action` consumes from another stage."""
    stage = stage_of(rank, action.chunk, pp, placement)
    if action.kind == F and stage > 0:
        return (F, *holder_of(stage - 1, pp, placement))
    if action.kind == B and stage < pp * vpp - 1:
        return (B, *holder_of(stage + 1, pp, placement))
    return None


def peak_activations(actions: list[Action], split: bool) -> int:
    live = peak = 0
    release = W if split else B
    for a in actions:
        if a.kind == F:
            live += 1
            peak = max(peak, live)
        elif a.kind == release:
            live -= 1
    return peak


def simulate(
    schedule: list[list[Action]],
    pp: int,
    vpp: int,
    costs: Costs | None = None,
    split: bool | None = None,
    placement: str = "loop",
) -> SimResult:
    """Simulate `schedule` (compute-only ones get communication inserted first) with its stages
    held as `placement` says (actions.py).

    Raises DeadlockError naming the blocked ranks and what each waits for, and ScheduleError when
    a compute runs before its input (same-rank order wrong, or no RECV placed before it)."""
    check_placement(placement)
    costs = costs or Costs()
    if len(schedule) != pp:
        raise ScheduleError(f"schedule has {len(schedule)} ranks but pp={pp}; give one action list per rank")
    if split is None:
        split = any(a.kind == W for acts in schedule for a in acts)
    if pp > 1 and not has_comms(schedule):
        schedule = insert_comms(schedule, pp, vpp, placement)

    ptr = [0] * pp
    clock: list[Number] = [0] * pp
    busy: list[Number] = [0] * pp
    done: list[dict] = [dict() for _ in range(pp)]  # (kind, mb, chunk) -> end time, per rank
    inbox: list[dict] = [dict() for _ in range(pp)]  # (kind, mb, chunk) -> arrival, per rank
    channels: dict[tuple[int, int], deque] = {}
    timelines: list[list[Span]] = [[] for _ in range(pp)]

    def step(rank: int, a: Action) -> bool:
        """Execute `a` on `rank`; False when it must wait for a message."""
        key = (a.kind, a.microbatch, a.chunk)
        if a.kind in (RECV_F, RECV_B):
            q = channels.get((a.peer, rank))
            if not q:
                return False
            (kind, mb, chunk), arrival = q.popleft()
            want = (F if a.kind == RECV_F else B, a.microbatch, a.chunk)
            if (kind, mb, chunk) != want:
                raise ScheduleError(
                    f"rank {rank}: {a} expects the {'activation' if a.kind == RECV_F else 'gradient'} "
                    f"for {want[0]}{want[1]}.{want[2]} "
                    f"but rank {a.peer} sent {kind}{mb}.{chunk} first; receives on a pair of ranks must "
                    "follow the send order (is a send missing or out of order?)"
                )
            inbox[rank][want] = arrival
            clock[rank] = max(clock[rank], arrival)  # the receive blocks
            return True
        if a.kind in (SEND_F, SEND_B):
            src = (F if a.kind == SEND_F else B, a.microbatch, a.chunk)
            if src not in done[rank]:
                raise ScheduleError(
                    f"rank {rank}: {a} sends the output of {src[0]}{src[1]}.{src[2]} before that compute ran"
                )
            msg = message_of(Action(*src), rank, pp, vpp, placement)
            if msg is None or msg[1] != a.peer:
                where = (
                    "nowhere (it stays on this rank or ends the pipeline)"
                    if msg is None
                    else f"rank {msg[1]}"
                )
                raise ScheduleError(
                    f"rank {rank}: {a} sends to rank {a.peer} but that output belongs to {where}"
                )
            # the message is keyed by what the receiver will run with it: (kind, microbatch, its chunk)
            delivered = (src[0], a.microbatch, msg[2])
            channels.setdefault((rank, a.peer), deque()).append((delivered, done[rank][src] + costs.p2p))
            return True
        # compute
        if key in done[rank]:
            raise ScheduleError(f"rank {rank} runs {a} twice")
        ready = clock[rank]
        deps = []
        if a.kind == B:
            deps.append(((F, a.microbatch, a.chunk), rank, "its forward"))
        if a.kind == W:
            deps.append(((B, a.microbatch, a.chunk), rank, "its input-gradient B"))
        prod = _producer(a, rank, pp, vpp, placement)
        if prod is not None:
            deps.append(
                (
                    (prod[0], a.microbatch, prod[2]),
                    prod[1],
                    "the previous stage's output" if a.kind == F else "the next stage's gradient",
                )
            )
        for dep, dep_rank, why in deps:
            if dep_rank == rank:
                if dep not in done[rank]:
                    raise ScheduleError(
                        f"rank {rank}: {a} runs before {dep[0]}{dep[1]}.{dep[2]} ({why}); "
                        "move it after that action"
                    )
                ready = max(ready, done[rank][dep])
            else:
                mine = (a.kind, a.microbatch, a.chunk)
                if mine not in inbox[rank]:
                    raise ScheduleError(
                        f"rank {rank}: {a} needs {why} from rank {dep_rank} "
                        "but no receive for it comes first; "
                        f"insert_comms() places the receives"
                    )
                ready = max(ready, inbox[rank][mine])
        cost = costs.of(a, vpp, split)
        end = ready + cost
        timelines[rank].append(Span(ready, end, a))
        done[rank][key] = end
        clock[rank] = end
        busy[rank] += cost
        return True

    progressed = True
    while progressed:
        progressed = False
        for rank in range(pp):
            acts = schedule[rank]
            while ptr[rank] < len(acts) and step(rank, acts[ptr[rank]]):
                ptr[rank] += 1
                progressed = True
    if any(ptr[r] < len(schedule[r]) for r in range(pp)):
        raise DeadlockError(_deadlock_message(schedule, ptr))

    makespan = max((t[-1].end for t in timelines if t), default=0)
    return SimResult(
        pp=pp,
        vpp=vpp,
        costs=costs,
        split=split,
        schedule=schedule,
        timelines=timelines,
        makespan=makespan,
        busy=busy,
        peak_activations=[peak_activations(acts, split) for acts in schedule],
        microbatches=1 + max((a.microbatch for acts in schedule for a in acts), default=-1),
        placement=placement,
    )


def _deadlock_message(schedule: list[list[Action]], ptr: list[int]) -> str:
    """Name the cycle of blocked ranks (or the rank that finished without sending) first; ranks
    merely waiting behind it are listed last, so the line starts with what to fix."""
    blocked = {r: schedule[r][ptr[r]] for r in range(len(schedule)) if ptr[r] < len(schedule[r])}

    def waits(rank: int) -> str:
        a = blocked[rank]
        what = "activation" if a.kind == RECV_F else "gradient"
        needed = ("F" if a.kind == RECV_F else "B") + f"{a.microbatch}.{a.chunk}"
        return (
            f"rank {rank} blocks at {a} (step {ptr[rank]}) waiting for the {what} for {needed} "
            f"from rank {a.peer}"
        )

    rank, path = min(blocked), []
    while rank in blocked and rank not in path:  # follow "waits for" until it loops or ends
        path.append(rank)
        rank = blocked[rank].peer
    if rank in path:
        cycle = path[path.index(rank) :]
        head = f"deadlock between ranks {' -> '.join(map(str, cycle + [rank]))}: " + "; ".join(
            waits(r) for r in cycle
        )
    else:
        cycle = path[-1:]
        head = f"deadlock: {waits(path[-1])}, which finished without sending it"
    behind = sorted(set(blocked) - set(cycle))
    tail = f" (ranks {', '.join(map(str, behind))} wait behind them)" if behind else ""
    return (
        head + tail + ". Reorder F/B on these ranks so each rank sends what the other needs before it waits"
    )
