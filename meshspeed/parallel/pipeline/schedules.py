"""Pipeline schedules as pure functions `(pp, vpp, microbatches) -> list (per rank) of Actions`.

The functions here return compute actions only (F, B, W); `build_schedule` adds the SEND/RECV
actions implied by the stage placement (see comms.py), so the ordering logic of a schedule stays
readable and the communication rule lives in one place.

Virtual stage s = chunk * pp + rank (Megatron's interleaved placement, see actions.py).
"""

from __future__ import annotations

from collections.abc import Callable

from meshspeed.parallel.pipeline.actions import Action, B, F, ScheduleError, W
from meshspeed.parallel.pipeline.comms import insert_comms

ScheduleFn = Callable[[int, int, int], "list[list[Action]]"]

SCHEDULES: dict[str, ScheduleFn] = {}


def _register(name: str, *, interleaved: bool, split_backward: bool, summary: str):
    """Record a schedule plus the facts callers need without running it (vpp rule, B/W split)."""

    def deco(fn):
        fn.schedule_name = name
        fn.interleaved = interleaved  # True: needs vpp >= 2; False: vpp must be 1
        fn.split_backward = split_backward  # True: B is input-grad only and a W follows
        fn.summary = summary
        SCHEDULES[name] = fn
        return fn

    return deco


def get_schedule(name: str) -> ScheduleFn:
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ScheduleError(
            f"pipeline schedule {name!r} is unknown; valid schedules: {', '.join(SCHEDULES)}"
        ) from None


def build_schedule(name: str, pp: int, vpp: int, microbatches: int, comms: bool = True) -> list[list[Action]]:
    """The named schedule, with SEND/RECV actions inserted unless comms=False."""
    compute = get_schedule(name)(pp, vpp, microbatches)
    return insert_comms(compute, pp, vpp) if comms else compute


def _check(name: str, pp: int, vpp: int, m: int, *, interleaved: bool) -> None:
    for key, value in (("pp", pp), ("vpp", vpp), ("microbatches", m)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"{name}: {key}={value!r} is invalid; it must be an integer >= 1")
    if interleaved and vpp < 2:
        raise ScheduleError(
            f"{name}: vpp={vpp} but an interleaved schedule needs vpp >= 2 model chunks per rank; "
            "use vpp=2 or schedule '1f1b'"
        )
    if not interleaved and vpp != 1:
        raise ScheduleError(
            f"{name}: vpp={vpp} is not supported (one model chunk per rank); "
            "use vpp=1 or schedule 'interleaved'"
        )


@_register(
    "gpipe",
    interleaved=False,
    split_backward=False,
    summary="all forwards, then all backwards; holds m microbatches of activations",
)
def gpipe(pp: int, vpp: int, m: int) -> list[list[Action]]:
    _check("gpipe", pp, vpp, m, interleaved=False)
    return [[Action(F, i) for i in range(m)] + [Action(B, i) for i in range(m)] for _ in range(pp)]


@_register(
    "1f1b",
    interleaved=False,
    split_backward=False,
    summary="warmup pp-rank-1 forwards, then one forward / one backward; holds <= pp microbatches",
)
def one_f_one_b(pp: int, vpp: int, m: int) -> list[list[Action]]:
    _check("1f1b", pp, vpp, m, interleaved=False)
    out = []
    for rank in range(pp):
        # Rank r must have started pp-r microbatches before the first gradient can come back to it.
        warmup = min(pp - rank - 1, m)
        acts = [Action(F, i) for i in range(warmup)]
        for i in range(m - warmup):
            acts += [Action(F, warmup + i), Action(B, i)]
        acts += [Action(B, i) for i in range(m - warmup, m)]
        out.append(acts)
    return out


def _interleaved_table(pp: int, vpp: int, m: int) -> list[tuple[int, int]]:
    """Megatron's (microbatch, chunk) forward order: microbatches in groups of pp, each group run
    through chunk 0, then chunk 1, ... (m is a multiple of pp)."""
    return [(mb, c) for start in range(0, m, pp) for c in range(vpp) for mb in range(start, start + pp)]


def _interleaved(name: str, pp: int, vpp: int, m: int, extra_warmup: int) -> list[list[Action]]:
    _check(name, pp, vpp, m, interleaved=True)
    if m < pp or m % pp:
        # Megatron's form: microbatches run in groups of pp through chunk 0, then chunk 1, ...
        # With a ragged last group the warmup counts no longer match and some (pp, vpp, m)
        # deadlock (e.g. pp 4, vpp 3, m 5), so the shape is required rather than patched.
        ok = max(pp, -(-m // pp) * pp)
        raise ScheduleError(
            f"{name}: microbatches={m} must be a multiple of pp={pp} (and >= pp) for interleaved schedules",
            microbatches=ok,
        )
    fwd = _interleaved_table(pp, vpp, m)
    # Backward visits the same microbatch groups with chunks in reverse (the last stage goes first).
    bwd = [(mb, vpp - 1 - c) for mb, c in fwd]
    total = len(fwd)
    out = []
    for rank in range(pp):
        # Megatron's warmup: enough forwards that chunk vpp-1 of this rank has seen its first
        # microbatch group before the first backward comes back.
        warmup = min((pp - rank - 1) * 2 + (vpp - 1) * pp + extra_warmup, total)
        acts = [Action(F, *fwd[k]) for k in range(warmup)]
        for k in range(total - warmup):
            acts += [Action(F, *fwd[warmup + k]), Action(B, *bwd[k])]
        acts += [Action(B, *bwd[k]) for k in range(total - warmup, total)]
        out.append(acts)
    return out


@_register(
    "interleaved",
    interleaved=True,
    split_backward=False,
    summary="Megatron interleaved 1F1B over vpp model chunks per rank; bubble / vpp",
)
def interleaved(pp: int, vpp: int, m: int) -> list[list[Action]]:
    return _interleaved("interleaved", pp, vpp, m, extra_warmup=0)


@_register(
    "interleaved-extra-warmup",
    interleaved=True,
    split_backward=False,
    summary="interleaved + 1 extra warmup forward per rank: each steady F/B pair is independent, "
    "so they and their p2p can overlap",
)
def interleaved_extra_warmup(pp: int, vpp: int, m: int) -> list[list[Action]]:
    # One more microbatch in flight per rank (one chunk's activations of memory) buys a steady
    # state in which the forward a rank runs next never depends on the gradient it is about to
    # send, so sends/receives can run behind compute (MindSpeed's cheap alternative to DualPipe).
    return _interleaved("interleaved-extra-warmup", pp, vpp, m, extra_warmup=1)


@_register(
    "zero-bubble",
    interleaved=False,
    split_backward=True,
    summary="ZB-H1: backward split into B (input grad) and W (weight grad); "
    "W deferred into the cooldown bubble",
)
def zero_bubble(pp: int, vpp: int, m: int) -> list[list[Action]]:
    _check("zero-bubble", pp, vpp, m, interleaved=False)
    out = []
    for rank in range(pp):
        warmup = min(pp - rank - 1, m)
        # ZB-H1 keeps up to `rank` W's pending: rank r has warmup+1 = pp-r microbatches live in
        # steady state, plus r deferred W's = pp, the same peak as 1F1B's rank 0. Later ranks
        # defer more because their cooldown bubble (waiting for nothing) is longer.
        deferred = rank
        acts = [Action(F, i) for i in range(warmup)]
        pending: list[int] = []

        def backward(i: int) -> None:
            acts.append(Action(B, i))
            pending.append(i)
            while len(pending) > deferred:
                acts.append(Action(W, pending.pop(0)))

        for i in range(m - warmup):
            acts.append(Action(F, warmup + i))
            backward(i)
        for i in range(m - warmup, m):
            backward(i)
        acts += [Action(W, i) for i in pending]
        out.append(acts)
    return out
