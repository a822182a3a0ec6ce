"""Simulated bubbles equal the closed forms; memory and overlap behave as each schedule claims."""

from fractions import Fraction

import pytest

from meshspeed.parallel.pipeline import (
    Costs,
    ScheduleError,
    build_schedule,
    closed_form,
    evaluate,
    fb_overlap,
    simulate,
)


def test_1f1b_pp4_m8_is_exactly_3_over_11():
    r = evaluate("1f1b", 4, 1, 8)
    assert r.bubble == Fraction(3, 11)
    assert isinstance(r.bubble, Fraction)
    assert r.makespan == 33  # (m + p - 1) * (f + b + w)
    assert r.bubble_per_rank == [Fraction(3, 11)] * 4


@pytest.mark.parametrize("pp,m", [(1, 3), (2, 2), (3, 7), (4, 8), (5, 3), (5, 12)])
@pytest.mark.parametrize("costs", [Costs(), Costs(1, 2, 0), Costs(Fraction(3, 2), 1, Fraction(1, 3))])
def test_1f1b_and_gpipe_closed_form(pp, m, costs):
    for name in ("1f1b", "gpipe"):
        assert evaluate(name, pp, 1, m, costs).bubble == Fraction(pp - 1, m + pp - 1)


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 4), (3, 2, 6), (4, 2, 8), (4, 3, 12), (5, 2, 10), (3, 3, 3)])
@pytest.mark.parametrize("name", ["interleaved", "interleaved-extra-warmup"])
def test_interleaved_closed_form(name, pp, vpp, m):
    for costs in (Costs(), Costs(2, 3, 1)):
        r = evaluate(name, pp, vpp, m, costs)
        assert r.bubble == Fraction(pp - 1, vpp * m + pp - 1)
        assert closed_form(name, pp, vpp, m, costs)[0] == r.bubble


@pytest.mark.parametrize("pp,m", [(2, 2), (3, 5), (4, 8), (5, 9)])
def test_zero_bubble_closed_form_with_equal_costs(pp, m):
    for unit in (1, Fraction(5, 2)):
        r = evaluate("zero-bubble", pp, 1, m, Costs(unit, unit, unit))
        assert r.bubble == Fraction(pp - 1, 3 * m + pp - 1)


def test_ordering_at_pp4_m8():
    bubble = {
        name: evaluate(name, 4, 2 if "interleaved" in name else 1, 8).bubble
        for name in ("gpipe", "1f1b", "interleaved", "interleaved-extra-warmup", "zero-bubble")
    }
    assert bubble["gpipe"] == bubble["1f1b"] == Fraction(3, 11)
    assert bubble["interleaved"] == Fraction(3, 19) < bubble["1f1b"]
    assert bubble["zero-bubble"] == Fraction(1, 9) < bubble["interleaved"]


def test_peak_activations():
    for pp, m in [(4, 8), (3, 2), (5, 11)]:
        one = evaluate("1f1b", pp, 1, m).peak_activations
        assert one == [min(pp - r, m) for r in range(pp)]
        assert max(one) <= pp
        assert evaluate("gpipe", pp, 1, m).peak_activations == [m] * pp
        # ZB-H1: counted until W, every rank peaks at what 1F1B's rank 0 holds
        assert max(evaluate("zero-bubble", pp, 1, m).peak_activations) == max(one)
    # interleaved holds more microbatch-chunks; the extra warmup costs exactly one more per rank
    il = evaluate("interleaved", 4, 2, 8).peak_activations
    assert [a + 1 for a in il] == evaluate("interleaved-extra-warmup", 4, 2, 8).peak_activations


def test_extra_warmup_makes_every_steady_pair_independent():
    for pp, vpp, m in [(2, 2, 4), (4, 2, 8), (3, 3, 6)]:
        plain = fb_overlap(build_schedule("interleaved", pp, vpp, m, comms=False), pp)
        extra = fb_overlap(build_schedule("interleaved-extra-warmup", pp, vpp, m, comms=False), pp)
        assert plain[0] < plain[1]
        assert extra[0] == extra[1] > 0


def test_p2p_latency_lengthens_makespan_and_floats_work():
    base = evaluate("1f1b", 4, 1, 8).makespan
    slow = evaluate("1f1b", 4, 1, 8, Costs(p2p=Fraction(1, 4)))
    assert slow.makespan > base
    assert closed_form("1f1b", 4, 1, 8, slow.costs) is None
    fl = evaluate("1f1b", 4, 1, 8, Costs(1.0, 1.0, 1.0, 0.0))
    assert fl.bubble == pytest.approx(3 / 11)


def test_timeline_is_consistent():
    r = evaluate("interleaved", 3, 2, 6, Costs(p2p=Fraction(1, 10)))
    for timeline in r.timelines:
        for a, b in zip(timeline, timeline[1:]):
            assert a.end <= b.start  # one compute at a time per rank
    assert r.makespan == max(t[-1].end for t in r.timelines)
    assert sum(r.idle) == r.bubble * r.pp * r.makespan


def test_negative_cost_rejected():
    with pytest.raises(ScheduleError, match="cost f=-1 is negative"):
        Costs(f=-1)


def test_simulate_inserts_comms_for_compute_only_schedule():
    compute = build_schedule("1f1b", 3, 1, 4, comms=False)
    assert simulate(compute, 3, 1).bubble == evaluate("1f1b", 3, 1, 4).bubble


@pytest.mark.parametrize("pp,m", [(1, 2), (2, 4), (2, 7), (3, 6), (4, 8), (4, 13), (5, 10)])
def test_dualpipev_closed_form(pp, m):
    """Equal costs: every rank idles (p-1)·f/2, so the bubble is (p-1)/(6m+p-1), half of ZB-H1's
    idle time; peak activations 2pp+1 stage-activations per rank (DualPipe's README: PP+1 for
    PP = 2pp stages)."""
    for unit in (1, Fraction(5, 2)):
        r = evaluate("dualpipev", pp, 2, m, Costs(unit, unit, unit))
        assert r.bubble == Fraction(pp - 1, 6 * m + pp - 1) == closed_form("dualpipev", pp, 2, m, r.costs)[0]
        assert set(r.bubble_per_rank) == {r.bubble}
    assert r.peak_activations == [2 * pp + 1] * pp
    assert closed_form("dualpipev", pp, 2, m, Costs(1, 2, 1)) is None
    if pp > 1:
        assert r.bubble < evaluate("zero-bubble", pp, 1, m).bubble


def test_dualpipev_pairs_are_independent():
    """Every adjacent F->B pair of DualPipeV is independent except the last stage's own
    F -> B on rank 0 (its loss), once per micro-batch before the steady phase."""
    pp, m = 4, 10
    r = evaluate("dualpipev", pp, 2, m)
    indep, total = fb_overlap(r.schedule, pp, "v")
    assert total - indep == pp - 1
