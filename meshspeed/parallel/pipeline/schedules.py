"""Pipeline schedules as pure functions `(pp, vpp, microbatches) -> list (per rank) of Actions`.

The functions here return compute actions only (F, B, W); `build_schedule` adds the SEND/RECV
actions implied by the stage placement (see comms.py), so the ordering logic of a schedule stays
readable and the communication rule lives in one place.

Virtual stage s = chunk * pp + rank (Megatron's interleaved placement, "loop") for all but
DualPipeV, whose two chunks per rank form a V ("v": rank r holds stages r and 2pp-1-r); each
schedule declares its placement and everything downstream (comms, simulation, stage layouts,
the runtime) reads it from there (see actions.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from meshspeed.parallel.pipeline.actions import Action, B, F, ScheduleError, W
from meshspeed.parallel.pipeline.comms import insert_comms

ScheduleFn = Callable[[int, int, int], "list[list[Action]]"]

SCHEDULES: dict[str, ScheduleFn] = {}


def _register(
    name: str,
    *,
    interleaved: bool,
    split_backward: bool,
    summary: str,
    placement: str = "loop",
    chunks: int | None = None,
):
    """Record a schedule plus the facts callers need without running it (vpp rule, B/W split,
    stage placement)."""

    def deco(fn):
        fn.schedule_name = name
        fn.interleaved = interleaved  # True: needs vpp >= 2; False: vpp must be 1
        fn.chunks = chunks  # the one vpp the schedule takes, when it takes exactly one
        fn.split_backward = split_backward  # True: B is input-grad only and a W follows
        fn.placement = placement  # "loop" or "v": which rank holds which stage (actions.py)
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
    fn = get_schedule(name)
    compute = fn(pp, vpp, microbatches)
    return insert_comms(compute, pp, vpp, fn.placement) if comms else compute


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


@_register(
    "dualpipev",
    interleaved=True,
    chunks=2,
    split_backward=True,
    placement="v",
    summary="DualPipeV: two chunks per rank in a V, steady state pairs a forward of one chunk "
    "with a backward of the other (overlappable); needs m >= 2pp",
)
def dualpipev(pp: int, vpp: int, m: int) -> list[list[Action]]:
    """DeepSeek's DualPipeV (Sea AI Lab's "cut-in-half" DualPipe), phase by phase.

    Rank r holds stage r (chunk 0, going down) and stage 2pp-1-r (chunk 1, coming back up),
    so rank 0 embeds and computes the loss. Each chunk takes micro-batches in order. A full
    backward is written "B W" back to back; a backward whose weight part is deferred (the
    zero-bubble trick, used only where it fills a bubble) is a B whose W comes later, in FIFO
    order. The steady phase alternates F0 B1 | F1 B0: a forward of one micro-batch next to the
    backward of another on the other chunk, which a runtime may run as one overlapped step."""
    _check("dualpipev", pp, vpp, m, interleaved=True)
    if vpp != 2:
        raise ScheduleError(
            f"dualpipev: vpp={vpp} but DualPipeV holds exactly 2 model chunks per rank; use vpp=2"
        )
    if m < 2 * pp:
        # below 2pp the steady phase of the first ranks would need micro-batches that the
        # warmup has not produced yet: the phase counts go negative
        raise ScheduleError(f"dualpipev: microbatches={m} must be >= 2 * pp = {2 * pp}", microbatches=2 * pp)
    return [_dualpipev_rank(pp, r, m) for r in range(pp)]


def _dualpipev_rank(pp: int, r: int, m: int) -> list[Action]:
    acts: list[Action] = []
    nf, nb = [0, 0], [0, 0]  # next micro-batch per chunk
    deferred: deque = deque()  # (mb, chunk) whose W has not run yet

    def fwd(c: int) -> None:
        acts.append(Action(F, nf[c], c))
        nf[c] += 1

    def bwd(c: int, defer: bool = False) -> None:
        acts.append(Action(B, nb[c], c))
        (deferred.append((nb[c], c)) if defer else acts.append(Action(W, nb[c], c)))
        nb[c] += 1

    def weight() -> None:
        acts.append(Action(W, *deferred.popleft()))

    down, up = pp - r - 1, r + 1  # ranks below and (with this one) above this rank
    for _ in range(2 * down):  # fill: chunk 0 only, the deeper ranks are still idle
        fwd(0)
    for _ in range(up):  # both chunks: the first micro-batches turn round at the V's bottom
        fwd(0)
        fwd(1)
    for _ in range(down):  # the gradient goes back before W: the rank above waits on it
        bwd(1, defer=True)
        weight()
        fwd(1)
    for _ in range(m - 2 * pp + up):  # steady: F0|B1 and F1|B0 pairs
        fwd(0)
        bwd(1)
        fwd(1)
        bwd(0)
    for _ in range(down):  # chunk 0 has run out of forwards
        bwd(1)
        fwd(1)
        bwd(0)
    defer = False
    for i in range(up):  # drain; the second half defers W into the tail's bubble
        if i == up // 2 and r % 2 == 1:
            defer = True
        bwd(1, defer)
        if i == up // 2 and r % 2 == 0:
            defer = True
        bwd(0, defer)
    for _ in range(down):
        weight()
        bwd(0, defer=True)
    while deferred:
        weight()
    return acts
