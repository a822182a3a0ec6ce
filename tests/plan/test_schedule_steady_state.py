"""The run plan's pipeline simulation past SIM_CAP micro-batches: two shorter simulations
extrapolated through the steady state give the full simulation's bubble and peak in-flight
micro-batches exactly, for every schedule, and an invalid micro-batch count stays invalid."""

from __future__ import annotations

import pytest

import meshspeed.plan.schedule as schedule
from meshspeed.parallel.pipeline.actions import ScheduleError
from meshspeed.parallel.pipeline.analysis import evaluate

CASES = [
    ("gpipe", 4, 1),  # peak grows with m: extrapolated linearly
    ("1f1b", 3, 1),
    ("interleaved", 4, 2),
    ("interleaved-extra-warmup", 2, 3),
    ("zero-bubble", 4, 1),
    ("dualpipev", 3, 2),
]


@pytest.mark.parametrize("name,pp,vpp", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("m", [136, 203, 264])
def test_extrapolated_equals_full_simulation(monkeypatch, name, pp, vpp, m):
    monkeypatch.setattr(schedule, "SIM_CAP", 128)
    schedule._simulated.cache_clear()
    try:
        full = evaluate(name, pp, vpp, m)
    except ScheduleError:
        with pytest.raises(ScheduleError):
            schedule._simulated(name, pp, vpp, m)
        return
    got = schedule._simulated(name, pp, vpp, m)
    assert isinstance(got, schedule.SteadyState), "extrapolated, not simulated in full"
    assert got.bubble == pytest.approx(float(full.bubble), rel=1e-12, abs=0)
    assert list(got.peak_activations) == list(full.peak_activations)
    assert got.makespan == pytest.approx(float(full.makespan), rel=1e-12)


def test_only_short_simulations_run(monkeypatch):
    """65,536 micro-batches cost two simulations of at most SIM_CAP + a period."""
    seen = []
    real = schedule.__dict__.get("evaluate")  # imported inside _simulated: patch the source
    import meshspeed.parallel.pipeline.analysis as analysis

    def counting(name, pp, vpp, m, *a, **k):
        seen.append(m)
        return analysis_evaluate(name, pp, vpp, m, *a, **k)

    analysis_evaluate = analysis.evaluate
    monkeypatch.setattr(analysis, "evaluate", counting)
    schedule._simulated.cache_clear()
    got = schedule._simulated("1f1b", 8, 1, 65_536)
    assert real is None and len(seen) == 2 and max(seen) <= schedule.SIM_CAP + 16
    assert got.peak_activations == [8, 7, 6, 5, 4, 3, 2, 1]
    assert got.bubble == pytest.approx(7 / (65_536 + 7), rel=1e-12)  # (p-1)/(m+p-1)
