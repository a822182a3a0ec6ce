"""Pipeline settings checked before any worker starts: the schedule against vpp, the micro-batches
the schedule needs, the stage layout. The trainer's side (building stages, the step) is
meshspeed.train.pipeline."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from meshspeed.comm import ConfigError
from meshspeed.parallel.pipeline.actions import ScheduleError
from meshspeed.parallel.pipeline.schedules import build_schedule, get_schedule

# Micro-batches simulated action by action; beyond, two shorter simulations are extrapolated.
# A simulation costs time linear in the micro-batches (64 ranks, global batch 65,536: > 10 min
# in `meshspeed plan`), while past the fill every schedule here repeats one period.
SIM_CAP = 256


@dataclass(frozen=True)
class SteadyState:
    """What the run plan reads of a simulation (bubble, peak in-flight micro-batches per rank),
    extrapolated from two simulations in the steady state."""

    bubble: float
    peak_activations: list[int]
    makespan: float
    microbatches: int


@functools.cache
def _simulated(name: str, pp: int, vpp: int, microbatches: int):
    """The schedule's simulation at default costs: a pure function of these four numbers, which
    the planner asks for once per memory rung and micro-batch size. Callers read `bubble` and
    `peak_activations`.

    Past SIM_CAP micro-batches: simulate m1 and m2 = m1 + one period (2·pp·vpp), both ≡ m modulo
    the period (so m1 is valid exactly when m is: the schedules' rules are divisibility and a
    minimum). In the steady state each period adds the same work to every rank and no idle time,
    so the idle times agree and the makespan and any growing peak (GPipe holds every
    micro-batch) are linear in m; when the idle times differ the full simulation runs."""
    from meshspeed.parallel.pipeline.analysis import evaluate

    period = 2 * pp * vpp
    m1 = SIM_CAP // 2 - (SIM_CAP // 2 - microbatches) % period
    if microbatches <= SIM_CAP or m1 < 2 * period:
        return evaluate(name, pp, vpp, microbatches)
    m2 = m1 + period
    a, b = evaluate(name, pp, vpp, m1), evaluate(name, pp, vpp, m2)
    if a.idle != b.idle:
        return evaluate(name, pp, vpp, microbatches)
    extra = microbatches - m2
    makespan = b.makespan + (b.makespan - a.makespan) * extra / period
    peaks = [pb + (pb - pa) * extra // period for pa, pb in zip(a.peak_activations, b.peak_activations)]
    bubble = sum(b.idle) / (pp * makespan)
    return SteadyState(float(bubble), peaks, float(makespan), microbatches)


def check(cfg, recipe, microbatches: int):
    """Everything about the pipeline settings that can be wrong, as one ConfigError line, for
    the run plan: schedule vs vpp, micro-batches the schedule needs, the stage layout (layers vs
    pp*vpp, empty stages). Returns (stage layouts, the schedule's simulation), or ([], None)
    without pipeline parallelism."""
    from meshspeed.parallel.pipeline.stage import stage_layouts

    p = cfg.parallel
    if p.pp == 1:
        for key, value, default in (
            ("vpp", p.vpp, 1),
            ("pp_layout", p.pp_layout, ""),
            ("pp_overlap", p.pp_overlap, False),
        ):
            if value != default:
                raise ConfigError(
                    f"parallel.{key}={_show(value)} needs parallel.pp > 1 (pipeline stages); "
                    f"set --parallel.pp 2 or leave parallel.{key} at {_show(default)}"
                )
        return [], None
    key = f"parallel.pp_schedule={p.pp_schedule}"
    per = cfg.train.global_batch_size // microbatches  # sequences per micro-batch, all dp ranks
    try:
        fn = get_schedule(p.pp_schedule)
        if fn.interleaved and p.vpp < 2:
            raise ScheduleError(
                f"needs parallel.vpp >= 2 model chunks per rank (got vpp={p.vpp}); "
                f"set --parallel.vpp 2 or use --parallel.pp_schedule 1f1b"
            )
        if not fn.interleaved and p.vpp != 1:
            raise ScheduleError(
                f"runs one model chunk per rank but parallel.vpp={p.vpp}; use --parallel.vpp 1 or "
                f"--parallel.pp_schedule interleaved"
            )
        sim = _simulated(p.pp_schedule, p.pp, p.vpp, microbatches)
    except ScheduleError as e:
        hint = f"; e.g. train.global_batch_size={e.microbatches * per}" if e.microbatches else ""
        raise ConfigError(
            f"{key} with {microbatches} microbatches (train.global_batch_size / (micro_batch_size × dp) "
            f"= {cfg.train.global_batch_size} / {per}): {e}{hint}"
        ) from None
    if p.pp_overlap:
        _check_overlap(p, microbatches)
    # held where the schedule places them (DualPipeV's V: rank 0 embeds and computes the loss);
    # the trainer builds exactly these stages, so the placement is decided here, once
    return stage_layouts(recipe, p.pp, p.vpp, p.pp_layout, fn.placement), sim  # raises ConfigError lines


def _show(value) -> str:
    """A setting's value as it is typed (true, not True)."""
    return str(value).lower() if isinstance(value, bool) else repr(value)


def _check_overlap(p, microbatches: int) -> None:
    """parallel.pp_overlap on a schedule that has no forward/backward pair to run together at this
    shape (1F1B: each gradient arrives just after the forward before it) would change nothing
    while the user believes the exchanges are hidden: one line instead."""
    from meshspeed.parallel.pipeline.pairs import overlapped

    fn = get_schedule(p.pp_schedule)
    schedule = build_schedule(p.pp_schedule, p.pp, p.vpp, microbatches)
    _, starts = overlapped(schedule, p.pp, p.vpp, fn.placement, fn.split_backward)
    if not any(starts):
        raise ConfigError(
            f"parallel.pp_overlap=true with parallel.pp_schedule={p.pp_schedule} at pp {p.pp}, "
            f"{microbatches} micro-batches: the schedule has no independent forward/backward pair to "
            f"overlap; use --parallel.pp_schedule dualpipev (or zero-bubble, interleaved) or leave "
            f"parallel.pp_overlap off"
        )
