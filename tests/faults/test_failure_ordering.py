"""Which failure the launcher names as the root cause, from hand-made reports (no processes).

The launched tests (tests/faults/test_root_cause.py) see the ordering only when two ranks'
reports happen to reach the launcher in one poll. Here the reports are given: each rank's exit
code and what its pipe holds, (headline, detail, is_echo, culprits, when), as run_worker sends
them, and one poll of the launcher's `_Watch` must pick the failure that came first:
- a death by signal over any report (the error a peer raises is usually it noticing the death);
- among reports, the earliest made (`when`, the machine's monotonic clock), whatever the ranks'
  order or their pipes' order; a tie to the lower rank; a report without its time after the
  timed ones;
- an echo of another rank's failure only when no other report is there (and the job is over);
- a timeout naming its culprit: the culprit, "reported by" the rank that timed out.
"""

from __future__ import annotations

import math

import pytest

from meshspeed.comm import launch


class _Proc:
    def __init__(self, exitcode):
        self.exitcode, self.pid = exitcode, 1000

    def is_alive(self) -> bool:
        return self.exitcode is None


class _Conn:
    """A pipe end holding `report`, or closed without one (None), or still open and empty."""

    EMPTY = object()

    def __init__(self, report):
        self.report = report

    def poll(self) -> bool:
        if self.report is None:
            raise EOFError
        return self.report is not self.EMPTY

    def recv(self):
        return self.report


def _first(ranks: list[tuple]) -> tuple:
    """One poll over ranks given as (exit code, report); the launcher's (rank, line, detail)."""
    watch = launch._Watch([_Proc(c) for c, _ in ranks], [_Conn(r) for _, r in ranks], grace_s=1.0)
    watch.poll()
    return watch.first


def _rep(line: str, when: float | None, echo: bool = False, culprits=(), detail: str | None = None):
    rep = (line, detail or line, echo, list(culprits))
    return rep if when is None else (*rep, when)


BOOM = "ValueError: boom"
CLOSED = "DistBackendError: Connection closed by peer"


@pytest.mark.parametrize("order", ["cause on rank 1", "cause on rank 0"])
def test_the_earliest_report_is_the_root_cause_whatever_the_rank_order(order):
    cause, peer = _rep(BOOM, when=100.0), _rep(CLOSED, when=100.5)
    ranks = [(1, peer), (1, cause)] if order == "cause on rank 1" else [(1, cause), (1, peer)]
    want = 1 if order == "cause on rank 1" else 0
    assert _first(ranks) == (want, f"rank {want} failed: {BOOM}", "")


def test_earliest_of_four_reports_on_a_larger_job():
    whens = [7.0, 3.0, 9.0, 3.5]  # rank 1 first, though its pipe is read second
    ranks = [(1, _rep(f"E{r}: r{r}", when=w)) for r, w in enumerate(whens)]
    assert _first(ranks) == (1, "rank 1 failed: E1: r1", "")


def test_a_tie_goes_to_the_lower_rank_and_an_untimed_report_sorts_last():
    assert _first([(1, _rep("A: a", 5.0)), (1, _rep("B: b", 5.0))])[0] == 0
    # a report without its time (an older worker) does not outrank a timed one, whatever the rank
    assert _first([(1, _rep("A: a", None)), (1, _rep("B: b", 5.0))])[0] == 1
    assert _first([(1, _rep("A: a", 5.0)), (1, _rep("B: b", None))])[0] == 0
    assert launch._when(_rep("A: a", None)) == math.inf
    assert _first([(1, _rep("A: a", None)), (1, _rep("B: b", None))])[0] == 0


def test_the_detail_travels_with_the_chosen_report():
    tb = "Traceback (most recent call last):\n  ...\nValueError: boom"
    ranks = [(1, _rep(CLOSED, 2.0)), (1, _rep(BOOM, 1.0, detail=tb))]
    assert _first(ranks) == (1, f"rank 1 failed: {BOOM}", tb)


def test_a_death_by_signal_comes_before_any_report():
    ranks = [(1, _rep(BOOM, when=1.0)), (-9, None), (1, _rep(CLOSED, when=2.0))]
    rank, line, _ = _first(ranks)
    assert rank == 1 and "killed by SIGKILL" in line, line


def test_an_echo_yields_to_a_real_report_even_an_later_one():
    ranks = [(1, _rep("failed on rank 1, see its error", 1.0, echo=True)), (1, _rep(BOOM, 2.0))]
    assert _first(ranks) == (1, f"rank 1 failed: {BOOM}", "")
    # alone, once the job is over (nobody left to report), the echo is what there is
    alone = [(1, _rep("failed on rank 1, see its error", 1.0, echo=True)), (1, None)]
    assert _first(alone)[0] == 0


def test_an_echo_alone_waits_while_ranks_still_run():
    ranks = [(1, _rep("failed on rank 1, see its error", 1.0, echo=True)), (None, _Conn.EMPTY)]
    assert _first(ranks) is None


def test_a_timeout_names_its_culprit():
    ranks = [
        (1, _rep("a collective timed out waiting for rank 2", 1.0, culprits=[2])),
        (1, _rep(CLOSED, 3.0)),
        (1, None),  # the culprit: it exited without a report
    ]
    assert _first(ranks) == (2, "a collective timed out waiting for rank 2 (reported by rank 0)", "")


def test_a_rank_that_exits_without_a_report_is_named_when_nothing_else_is():
    ranks = [(0, None), (3, None)]
    assert _first(ranks) == (1, "rank 1 exited with code 3 without reporting an error", "")
