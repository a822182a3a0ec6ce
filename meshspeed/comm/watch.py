"""The launcher's view of its workers (comm/launch.py starts them): their reports, exit codes and
signals, which rank failed first and why, a rank still running after its peers, and the end of
whatever each worker started (its process group).

How the first failure is told apart from the ranks that only noticed it: a death by signal
first; then the earliest report (run_worker stamps each with the machine's clock); an echo of
another rank's failure waits a moment for the report it echoes; a meshspeed timeout names its
culprit (desync.py); a plain torch.distributed timeout, which knows none, names the ranks still
running without an error.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import sys
import time

# How long an echo of another rank's failure waits for that rank's own report.
_ECHO_WAIT_S = 2.0
# A collective's timeout as torch.distributed's backends word it (gloo: "Timed out waiting
# 5000ms for recv operation"; NCCL's watchdog: "collective operation timeout").
_RAW_TIMEOUT = re.compile(
    r"timed out waiting \d+ ?ms|collective operation timeout|watchdog caught|DistBackendError.*timed? ?out",
    re.IGNORECASE,
)
# How long after the other ranks finished a rank still running is named (once).
STRAGGLER_S = 30.0
# What a worker's death by each signal usually means, for the launcher's last line.
_SIGNAL_HINTS = {
    signal.SIGKILL: "out of memory?",
    signal.SIGSEGV: "a crash in native code",
    signal.SIGABRT: "aborted by native code",
    signal.SIGBUS: "a bus error (shared memory full?)",
    signal.SIGTERM: "terminated from outside",
    signal.SIGINT: "interrupted",
}


def signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def death(rank: int, code: int) -> str:
    if code < 0:
        hint = _SIGNAL_HINTS.get(-code)
        return f"rank {rank} was killed by {signal_name(-code)} (exit {code}){': ' + hint if hint else ''}"
    return f"rank {rank} exited with code {code} without reporting an error"


def when(report) -> float:
    """When a rank's report was made (run_worker's 5th field); inf when the report has none."""
    return report[4] if report and len(report) > 4 else math.inf


class Watch:
    """The launcher's view of its workers: reports, exit codes, the first failure."""

    def __init__(self, procs, conns, grace_s: float):
        self.procs, self.conns, self.grace_s = procs, conns, grace_s
        self.reports: dict[int, tuple | None] = {}
        self.first: tuple[int, str, str] | None = None  # (rank, last line, detail)
        self.stop_at: float | None = None
        self.echo_at: float | None = None  # when the first echo arrived
        self.done_at: float | None = None  # when a clean exit was first seen with ranks still running
        self.named = False  # the ranks still running were named
        self.timeout_at: float | None = None  # when a plain torch.distributed timeout was first seen

    def poll(self) -> None:
        for r, c in enumerate(self.conns):
            if r in self.reports:
                continue
            try:
                if c.poll():
                    self.reports[r] = c.recv()
                    if self.reports[r][2] and self.echo_at is None:
                        self.echo_at = time.monotonic()
            except (EOFError, OSError):  # exited (or died) without a report
                self.reports[r] = None
        if self.first is None:
            self._find_first()

    def _find_first(self) -> None:
        codes = [p.exitcode for p in self.procs]
        # Within one poll a death by signal is more likely the cause than an error (which
        # often is a peer noticing that death), and either than a bare non-zero exit.
        for r, code in enumerate(codes):
            if code is not None and code < 0:
                self.first = (r, death(r, code), "")
                return
        # An echo ("failed on rank 1, see its error") waits a moment for the report it echoes.
        settled = self.echo_at is not None and (
            time.monotonic() - self.echo_at > _ECHO_WAIT_S or not self.alive()
        )
        # the earliest report first (a plain torch.distributed error on the peer of a rank that
        # raised is not marked as an echo, and both reports often arrive within one poll)
        reports = sorted(self.reports.items(), key=lambda kv: (when(kv[1]), kv[0]))
        for echo_ok in (False, True) if settled else (False,):
            for r, rep in reports:
                if rep and rep[2] == echo_ok:
                    detail = rep[1] if rep[1] != rep[0] else ""
                    if len(rep) > 3 and rep[3]:  # a timeout whose root cause is another rank: it first
                        self.first = (rep[3][0], f"{rep[0]} (reported by rank {r})", detail)
                    elif _RAW_TIMEOUT.search(rep[0]):
                        self._raw_timeout(r, rep[0], detail, codes)
                    else:
                        self.first = (r, f"rank {r} failed: {rep[0]}", detail)
                    return
        for r, code in enumerate(codes):
            if code not in (None, 0) and r in self.reports and self.reports[r] is None:
                self.first = (r, death(r, code), "")
                return

    def _raw_timeout(self, r: int, line: str, detail: str, codes: list) -> None:
        """Rank r timed out in a collective meshspeed did not issue (plain torch.distributed,
        which knows no culprit): the rank it waited for is one still running without an error.
        The other ranks in that collective time out about together, so wait a moment for
        their reports before naming the ranks still silent; with none, r's own line stands."""
        silent = [q for q, c in enumerate(codes) if c is None and q not in self.reports]
        if silent and self.alive():
            if self.timeout_at is None:
                self.timeout_at = time.monotonic()
            if time.monotonic() - self.timeout_at <= _ECHO_WAIT_S:
                return  # undecided: the next poll looks again
        if not silent:
            self.first = (r, f"rank {r} failed: {line}", detail)
            return
        who = f"rank {silent[0]}" if len(silent) == 1 else f"ranks {', '.join(map(str, silent))}"
        self.first = (
            silent[0],
            f"{who} never arrived (still running, no error) where rank {r} timed out: {line}",
            detail,
        )

    def stop(self) -> None:
        """SIGTERM (and SIGCONT, for a stopped worker) to every live worker, once."""
        if self.stop_at is not None:
            return
        self.stop_at = time.monotonic()
        for p in self.procs:
            if p.is_alive():
                for sig in (signal.SIGTERM, signal.SIGCONT):
                    with contextlib.suppress(ProcessLookupError, TypeError):
                        os.kill(p.pid, sig)

    def escalate(self) -> None:
        if self.stop_at is not None and time.monotonic() - self.stop_at > self.grace_s:
            for p in self.procs:
                if p.is_alive():
                    p.kill()

    def straggler(self, nproc: int, after_s: float) -> None:
        """Name, once, the ranks still running `after_s` after every other rank exited cleanly."""
        if self.first is not None or self.named:
            return
        codes = [p.exitcode for p in self.procs]
        running = [r for r, c in enumerate(codes) if c is None]
        if not running or len(running) == nproc or any(c not in (None, 0) for c in codes):
            return
        if self.done_at is None:
            self.done_at = time.monotonic()
        if time.monotonic() - self.done_at < after_s:
            return
        self.named = True
        done = nproc - len(running)
        who = f"rank {running[0]} is" if len(running) == 1 else f"ranks {', '.join(map(str, running))} are"
        peers = "the other worker" if done == 1 else f"{done} other workers"
        print(
            f"meshspeed: {who} still running {after_s:g} s after {peers} finished; waiting "
            "(Ctrl-C or SIGTERM stops the job)",
            file=sys.stderr,
            flush=True,
        )

    def alive(self) -> bool:
        # pid is None for a worker never started (a signal arrived while starting the others)
        return any(p.pid is not None and p.exitcode is None for p in self.procs)

    def wait_all(self) -> None:
        """Stop everyone and wait until every worker is gone (SIGKILL after the grace)."""
        self.stop()
        while self.alive():
            self.escalate()
            time.sleep(0.05)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member that is not ours any more (setuid): not ours to wait on
        return False
    return True


def end_groups(procs, grace_s: float) -> None:
    """Stop what the workers started: SIGTERM to each worker's process group (every worker has
    exited and been reaped, so only its descendants are left there), SIGKILL after `grace_s`."""
    groups = [p.pid for p in procs if p.pid is not None]
    left = [g for g in groups if _group_alive(g)]
    for sig in (signal.SIGTERM, signal.SIGCONT):
        for g in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(g, sig)
    deadline = time.monotonic() + grace_s
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [g for g in left if _group_alive(g)]
    for g in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(g, signal.SIGKILL)


def conclude(watch: Watch, nproc: int) -> int:
    codes = [p.exitcode for p in watch.procs]
    if all(c == 0 for c in codes) and watch.first is None:
        return 0
    if watch.first is None:  # cannot happen: a non-zero code is a failure; stay honest anyway
        print(f"meshspeed: workers exited with codes {codes}", file=sys.stderr)
        return 1
    rank, line, detail = watch.first
    if detail:
        print(detail, file=sys.stderr)
    others = nproc - 1
    tail = {0: "", 1: " (the other worker was stopped)"}.get(
        others, f" (the other {others} workers were stopped)"
    )
    print(f"meshspeed: {line}{tail}", file=sys.stderr)
    return 1
