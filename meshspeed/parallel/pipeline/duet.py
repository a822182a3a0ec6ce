"""Run a forward and an independent backward as one overlapped step: two coroutines that hand
over at every point where one of them has an exchange in flight.

DualPipe's idea: while micro-batch i's MoE all-to-all is on the wire, compute micro-batch j's
backward, and while j's reverse all-to-all is on the wire, compute i's forward. Neither side's
arithmetic changes, only the order in which the two sides' operations are issued, so the
results are exactly those of running F then B.

How: the forward runs on the calling thread and the backward (the autograd engine, which runs
CPU work on the thread that calls it) on a helper thread, but never both at once: a baton
passes between them at `hand_over()` calls, which the exchanges make right after launching
(expert_comm.launch / land: forward after the dispatch or combine is posted, backward after the
reverse one is). With the baton, every collective on every group is issued in one order fixed
by the program, the same on every rank of a group, which order-matched transports need. A
side that reaches a hand-over after the other has finished just keeps going; outside a duet
`hand_over()` does nothing.

Thread-local torch state is the helper's own (grad mode on, no autocast): it only runs the
backward of graphs recorded earlier, which needs neither. Numerics: forwards stay on the
calling thread, so losses are bitwise those of the plain schedule; MKL may round a small matmul
differently on another thread (its conditional numerical reproducibility is off unless
MKL_CBWR is set), so gradients agree with the plain schedule's to float rounding.
"""

from __future__ import annotations

import threading
import time

_here = threading.local()  # .side = (duet, 0 | 1) while this thread is part of a duet


def hand_over() -> None:
    """Let the other side of the current duet run until it hands back (no-op outside one)."""
    side = getattr(_here, "side", None)
    if side is not None:
        side[0]._pause(side[1])


class Duet:
    """Two callables run as coroutines, one at a time, switching at hand_over().

    After run(): `busy[k]` is the wall time side k held the baton (seconds) and `switches`
    the number of hand-overs that passed it; the trace splits the pair's span by `busy`."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._turn = 0
        self._done = [False, False]
        self._since = 0.0
        self.busy = [0.0, 0.0]
        self.switches = 0

    def run(self, first, second) -> None:
        """first() on this thread, second() on a helper; returns when both have finished and
        re-raises the first exception either side raised."""
        errors: list[BaseException] = []

        def helper() -> None:
            _here.side = (self, 1)
            try:
                with self._cv:
                    while self._turn != 1:
                        self._cv.wait()
                second()
            except BaseException as e:  # handed to the caller's thread below
                errors.append(e)
            finally:
                _here.side = None
                self._finish(1)

        thread = threading.Thread(target=helper, name="meshspeed-duet-backward", daemon=True)
        self._since = time.perf_counter()
        thread.start()
        _here.side = (self, 0)
        try:
            first()
        except BaseException as e:
            errors.insert(0, e)
        finally:
            _here.side = None
            self._finish(0)
            with self._cv:
                while not self._done[1]:
                    self._cv.wait()
            thread.join()
        if errors:
            raise errors[0]

    def _account(self, side: int) -> None:
        now = time.perf_counter()
        self.busy[side] += now - self._since
        self._since = now

    def _pause(self, side: int) -> None:
        with self._cv:
            other = 1 - side
            if self._done[other]:
                return
            self._account(side)
            self.switches += 1
            self._turn = other
            self._cv.notify_all()
            while self._turn != side:
                self._cv.wait()

    def _finish(self, side: int) -> None:
        with self._cv:
            if self._turn == side:
                self._account(side)
            self._done[side] = True
            self._turn = 1 - side
            self._cv.notify_all()
