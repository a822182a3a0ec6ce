"""Group: a set of ranks that communicate, with its sequence counter, store and async machinery.

A Group wraps one torch ProcessGroup. It is what every meshspeed collective takes; layers
receive it explicitly (there is no global "current group"). Every collective goes through
`Group.issue`, which numbers it, records it in the flight recorder, runs the debug-mode desync
check, launches it and returns a Handle whose `wait()` enforces the timeout.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import queue
import re
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import meshspeed.comm.desync as desync
from meshspeed.comm.errors import CollectiveTimeout
from meshspeed.comm.protocols import CommView
from meshspeed.comm.trace import FlightRecorder, describe


class Stall(Exception):
    """Raised inside an algorithm when a point-to-point transfer passes its deadline, or when a
    peer dropped its connection (`cause`: the backend's words) — usually because that peer's
    own deadline passed first and it gave up. Both are diagnosed the same way: who never
    arrived is what the user needs, not the backend's socket error."""

    def __init__(self, cause: str = ""):
        super().__init__(cause)
        self.cause = cause


# What `teardown` ends: every context that made a group, every worker thread (weak references:
# they hold nothing alive; they only let the end of a process find what is still running).
_CONTEXTS: weakref.WeakSet = weakref.WeakSet()
_WORKERS: weakref.WeakSet = weakref.WeakSet()


def teardown(close_contexts: bool = True) -> None:
    """End this process's communication in order, before the interpreter's shutdown does it in
    any order: each live context closed (it meets its peers through the store, then destroys
    its process groups; `close_contexts=False` skips that meeting, for a process that is exiting
    anyway), every group's worker thread joined, the default process group destroyed. Safe to
    call twice; errors are not raised here (the work this process did is already done)."""
    for ctx in list(_CONTEXTS) if close_contexts else []:
        try:
            ctx.close()
        except Exception:  # a peer already gone: its connections are closed either way
            pass
    for w in list(_WORKERS):
        w.stop(timeout_s=5.0)
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # already half torn down: nothing more to do
            pass


atexit.register(teardown, False)  # last resort, for processes that never called it


# gloo's words when the other end of a pair went away mid-transfer.
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe")


def _is_timeout(err: BaseException) -> bool:
    return isinstance(err, (Stall, concurrent.futures.TimeoutError)) or "timed out" in str(err).lower()


def _peer_lost(err: BaseException) -> str:
    """The backend's words (source location and advice cut) if `err` says a peer closed its
    connection, else ''."""
    text = str(err).strip()
    if not any(k in text.lower() for k in _PEER_LOST):
        return ""
    text = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0])  # gloo's "[.../pair.cc:553] "
    return text.split(". ")[0][:160]


def wait_work(work, deadline: float, plain: bool = False) -> None:
    """Wait for a torch Work or a Future until `deadline` (time.monotonic); raise Stall after.

    `plain`: the backend's own timeout equals ours, so let it enforce the deadline — a plain
    `wait()` costs ~30 µs less per call than `wait(timeout)` on gloo, and its "timed out"
    error is diagnosed exactly like ours.
    """
    try:
        if isinstance(work, concurrent.futures.Future):
            work.result(timeout=max(deadline - time.monotonic(), 0.05))
        elif plain:
            work.wait()
        else:
            work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.05)))
    except BaseException as err:
        if isinstance(err, CollectiveTimeout):
            raise
        if _is_timeout(err):
            raise Stall() from None
        if cause := _peer_lost(err):
            raise Stall(cause) from None
        raise


@contextlib.contextmanager
def _as_submitter(device: int | None, stream):
    """Run a collective on the worker thread as the thread that submitted it would.

    torch keeps grad mode, autocast, the current CUDA device and the current stream per
    thread, and a fresh thread starts with grad mode ON. An algorithm only copies and adds
    into buffers (it records no autograd graph), but the caller often made those buffers as
    views inside an autograd Function's forward or under no_grad — and an in-place write to
    such a view with grad mode on raises ("A view was created in no_grad mode and is being
    modified inplace"). So the work runs under no_grad with autocast off (a copy must not
    change dtype), on the submitter's device and stream (so it is ordered after the kernels
    that produced its inputs)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        stack.enter_context(torch.autocast("cpu", enabled=False))
        if device is not None:
            stack.enter_context(torch.autocast("cuda", enabled=False))
            stack.enter_context(torch.cuda.device(device))
            stack.enter_context(torch.cuda.stream(stream))
        yield


class _Worker:
    """One daemon thread running a group's asynchronous algorithm collectives in issue order.

    Daemon (unlike ThreadPoolExecutor's) so that a collective stuck on a dead peer can never
    keep the interpreter from exiting. But a daemon thread must not be inside native code when
    the interpreter shuts down: returning from it then kills the thread by a forced unwind
    through C++ frames, which aborts the whole process ("terminate called without an active
    exception"). So it is stopped and joined before shutdown (`stop`, from Group.close and
    `teardown`), once the collectives it was given have finished.
    """

    def __init__(self, name: str):
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        _WORKERS.add(self)

    def _loop(self):
        while True:
            item = self._q.get()
            if item is None:  # stop(): nothing after it was submitted
                return
            fut, fn, device, stream = item
            if fut.set_running_or_notify_cancel():
                try:
                    with _as_submitter(device, stream):
                        fut.set_result(fn())
                except BaseException as err:  # delivered to whoever waits on the handle
                    fut.set_exception(err)

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Queue `fn`; it runs as the submitting thread would run it (see _as_submitter)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        device = stream = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            device, stream = torch.cuda.current_device(), torch.cuda.current_stream()
        self._q.put((fut, fn, device, stream))
        return fut

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Finish what was submitted, end the thread; False if it is still busy after `timeout_s`
        (a collective stuck on a dead peer: left to the process's exit)."""
        self._q.put(None)
        self._thread.join(timeout_s)
        _WORKERS.discard(self)
        return not self._thread.is_alive()


class Handle:
    """Returned by a collective called with async_op=True. `wait()` returns the result."""

    def __init__(self, group: Group, seq: int, entry: dict | None, sig: dict, pending: list, finish):
        self._group, self._seq, self._entry, self._sig = group, seq, entry, sig
        self._pending, self._finish = pending, finish
        self._issued = time.monotonic()
        self._done = False
        self._result = None

    def _desc(self) -> str:
        return describe(self._sig["op"], self._sig["shape"], self._sig["dtype"])

    def is_completed(self) -> bool:
        if self._done:
            return True
        for w in self._pending:
            if not (w.done() if isinstance(w, concurrent.futures.Future) else w.is_completed()):
                return False
        return True

    def wait(self):
        if self._done:
            return self._result
        ctx = self._group.ctx
        deadline = self._issued + ctx.timeout_s
        try:
            for w in self._pending:
                wait_work(w, deadline, self._group.plain_wait)
        except Stall as stall:
            FlightRecorder.finish(self._entry, "timed_out")
            raise desync.diagnose_timeout(
                self._group, self._seq, self._desc(), ctx.timeout_s, stall.cause
            ) from None
        except BaseException:
            FlightRecorder.finish(self._entry, "failed")
            raise
        self._result = self._finish() if self._finish else None
        self._done = True
        FlightRecorder.finish(self._entry)
        return self._result


class Done(Handle):
    """A handle for work that already finished (single-member groups, synchronous algorithms)."""

    def __init__(self, result=None):
        self._done, self._result = True, result


class Group:
    """Members (global ranks, in group order), this rank's index, and the means to talk to them."""

    def __init__(
        self, ctx: CommView, pg, ranks: list[int], name: str, backend_timeout_s: float | None = None
    ):
        self.ctx = ctx
        self.pg = pg
        # The process group's own timeout (None: unknown, e.g. a group someone else made). The
        # backend enforces it even where meshspeed does not wait (NCCL's watchdog, DCP's
        # collectives), so meshspeed makes every group with its timeout.
        self.backend_timeout_s = backend_timeout_s
        self.ranks = list(ranks)
        self.size = len(ranks)
        self.rank = self.ranks.index(ctx.rank)
        self.name = name
        self.nodes = [ctx.node_of(r) for r in self.ranks]  # node id of each member
        self.seq = 0
        self.store = ctx.prefixed_store(f"meshspeed/{name}/") if self.size > 1 else None
        self.backend = ctx.backend
        self._worker: _Worker | None = None
        self.algo_choices: dict = {}  # memo of the cost model's algorithm choice per (op, bytes)
        self.algo_params = None  # the link parameters those choices came from
        _CONTEXTS.add(ctx)

    @property
    def plain_wait(self) -> bool:
        """The process group enforces our deadline itself (see wait_work)."""
        return self.backend_timeout_s is not None and self.ctx.timeout_s >= self.backend_timeout_s

    def __repr__(self) -> str:
        return f"Group({self.name}, ranks={self.ranks}, rank={self.rank})"

    @property
    def global_rank(self) -> int:
        return self.ranks[self.rank]

    def worker(self) -> _Worker:
        if self._worker is None:
            self._worker = _Worker(f"meshspeed-{self.name}")
        return self._worker

    def close(self) -> None:
        """Stop this group's worker thread and drop its process group (the context destroys the
        process groups once every reference is gone)."""
        if self._worker is not None:
            self._worker.stop()
            self._worker = None
        self.pg = None

    def issue(
        self,
        sig: dict,
        algo: str,
        nbytes: int,
        start: Callable[[float, int], list],
        finish: Callable[[], Any] | None,
        async_op: bool,
    ):
        """Number, record, check and launch one collective.

        `start(deadline, seq)` launches the transfers and returns what to wait on (torch Works
        or a Future); `finish()` builds the result once they completed.
        """
        self.seq += 1
        seq = self.seq
        ctx = self.ctx
        entry = ctx.recorder.record(seq, self.name, sig["op"], sig["shape"], sig["dtype"], algo, nbytes)
        if ctx.debug:
            try:
                desync.check(self, seq, sig, ctx.timeout_s)
            except Exception:
                FlightRecorder.finish(entry, "failed")
                raise
        try:
            pending = start(time.monotonic() + ctx.timeout_s, seq)
        except Stall as stall:
            FlightRecorder.finish(entry, "timed_out")
            desc = describe(sig["op"], sig["shape"], sig["dtype"])
            raise desync.diagnose_timeout(self, seq, desc, ctx.timeout_s, stall.cause) from None
        except BaseException:
            FlightRecorder.finish(entry, "failed")
            raise
        handle = Handle(self, seq, entry, sig, pending, finish)
        return handle if async_op else handle.wait()

    def p2p_deadline(self) -> float:
        return time.monotonic() + self.ctx.timeout_s

    def p2p_timeout(self, what: str, peer: int, cause: str = "") -> CollectiveTimeout:
        who = self.ranks[peer]
        if cause:  # the peer left (its own deadline passed first, or it died) before ours did
            why = f"failed on rank {self.global_rank}: rank {who} closed its connection ({cause})"
        else:
            why = (
                f"timed out after {self.ctx.timeout_s:g}s on rank {self.global_rank}: rank {who} never "
                "posted the matching transfer"
            )
        # the root cause first, as for a collective: a peer that stopped (or is itself stuck
        # behind one) has a heartbeat that stopped moving
        stalled = [] if cause else desync.stalled_ranks(self.ctx) or []
        root = desync.root_cause(stalled) if stalled else "meshspeed: "
        err = CollectiveTimeout(
            f"{root}{what} with rank {who} on group {self.name} {why}\n"
            f"  last collectives on this rank:\n{self.ctx.recorder.format_tail(5)}"
        )
        err.culprits = stalled
        return err


class Lane:
    """The point-to-point exchanges of one algorithm run, each with its own tag.

    Tags carry the collective's sequence number so that algorithms running concurrently on
    the same group (one on the async worker, one on the caller's thread) never match each
    other's messages. Send and receive of a step go out as one batch: NCCL deadlocks a ring
    whose sends and receives are posted separately.
    """

    _BASE = 1 << 28  # above any tag a user is likely to pick for plain send/recv

    def __init__(self, group: Group, seq: int, deadline: float):
        self.group, self.deadline = group, deadline
        self._tag = self._BASE | ((seq & 0xFFFF) << 12)
        self._step = 0

    def skip(self, steps: int) -> None:
        """Advance the tag counter by `steps` a peer performs while this rank sits them out."""
        self._step += steps

    def exchange(
        self, send: torch.Tensor | None, dst: int | None, recv: torch.Tensor | None, src: int | None
    ):
        """Send `send` to member `dst` and receive into `recv` from member `src` (either optional)."""
        g = self.group
        tag = self._tag | (self._step & 0xFFF)
        self._step += 1
        ops = []
        if send is not None and send.numel():
            ops.append(dist.P2POp(dist.isend, send, g.ranks[dst], g.pg, tag))
        if recv is not None and recv.numel():
            ops.append(dist.P2POp(dist.irecv, recv, g.ranks[src], g.pg, tag))
        if not ops:
            return
        plain = g.plain_wait
        for work in dist.batch_isend_irecv(ops):
            wait_work(work, self.deadline, plain)
