"""Pipeline settings checked before any worker starts: the schedule against vpp, the micro-batches
the schedule needs, the stage layout. The trainer's side (building stages, the step) is
meshspeed.train.pipeline."""

from __future__ import annotations

import functools

from meshspeed.comm import ConfigError
from meshspeed.parallel.pipeline.actions import ScheduleError
from meshspeed.parallel.pipeline.schedules import build_schedule, get_schedule


@functools.cache
def _simulated(name: str, pp: int, vpp: int, microbatches: int):
    """The schedule's simulation at default costs: a pure function of these four numbers, which
    the planner asks for once per memory rung and micro-batch size (hours at thousands of GPUs
    on a small CPU when each call simulates again). Callers only read the result."""
    from meshspeed.parallel.pipeline.analysis import evaluate

    return evaluate(name, pp, vpp, microbatches)


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
