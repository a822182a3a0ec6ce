"""Desync detection and timeout diagnosis through the rendezvous store.

The store (the TCPStore every torch.distributed job already has) is a side channel that works
even when the collective itself would hang. Two protocols use it:

* debug mode (MESHSPEED_DEBUG=1): before each collective every member posts its call signature
  under `sig/<seq>/<member>` and waits for the others'. Mismatches raise the same DesyncError
  on every rank (they all read the same signatures); a member that never posts is named.
* timeout diagnosis (always on): a rank whose collective timed out posts `stuck/<seq>/<member>`
  and waits a short grace period; members that posted too are waiting in the same collective,
  the others never arrived. Nothing is written on the fast path.
* root cause (always on): every rank's heartbeat thread bumps a counter in the store every
  second. A rank missing from a collective is often itself waiting on a third one (rank 0 waits
  for rank 2 in dp while rank 2 waits for the stopped rank 3 in tp), so the diagnosis also
  reads every rank's counter twice, 2 s apart, when a member is missing: a rank whose counter
  stopped (SIGSTOP, a frozen host, a death) or never started is the one that stopped making
  progress, and the error names it first (`CollectiveTimeout.culprits`). A rank that is alive
  but busy outside communication keeps beating: it is named as the member that did not arrive.
"""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from datetime import timedelta

from meshspeed.comm.errors import CollectiveTimeout, DesyncError
from meshspeed.comm.protocols import GroupView
from meshspeed.comm.trace import describe


def _ranks(xs) -> str:
    return ",".join(str(x) for x in xs)


def signature(op: str, shape, dtype: str, key: str = "", splits: dict | None = None) -> dict:
    """What a rank is about to call. `key` holds what must agree besides op/dtype/shape
    (reduce op, broadcast source, the gathered dim's sizes...). all_to_all carries its splits
    instead of a shape, since its shapes legitimately differ between ranks."""
    sig = {"op": op, "shape": list(shape), "dtype": dtype, "key": key}
    if splits is not None:
        sig["splits"] = splits
    return sig


def _agree_key(sig: dict) -> tuple:
    shape = None if "splits" in sig else tuple(sig["shape"])
    return (sig["op"], sig["dtype"], shape, sig["key"])


def _desc(sig: dict, with_key: bool) -> str:
    return describe(sig["op"], sig["shape"], sig["dtype"], sig["key"] if with_key else "")


def compare(sigs: list[dict], global_ranks: list[int], seq: int) -> str | None:
    """Return the desync message for these per-member signatures, or None if they agree."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for member, sig in enumerate(sigs):
        groups[_agree_key(sig)].append(member)
    if len(groups) > 1:
        # The majority is "what was expected"; ties go to the group holding the lowest rank.
        ordered = sorted(groups.values(), key=lambda ms: (-len(ms), ms[0]))
        ref = ordered[0]
        descs = {m: _desc(sigs[m], with_key=False) for m in range(len(sigs))}
        with_key = len(set(descs.values())) == 1  # differ only in the key: show it
        ref_desc = _desc(sigs[ref[0]], with_key)
        parts = []
        for ms in ordered[1:]:
            who = "rank" if len(ms) == 1 else "ranks"
            parts.append(
                f"{who} {_ranks(global_ranks[m] for m in ms)} called {_desc(sigs[ms[0]], with_key)} "
                f"at seq {seq} where {'rank' if len(ref) == 1 else 'ranks'} "
                f"{_ranks(global_ranks[m] for m in ref)} called {ref_desc}"
            )
        return "; ".join(parts)
    # Same op everywhere; for all_to_all check that what i sends to j is what j expects from i.
    if "splits" in sigs[0]:
        for i, si in enumerate(sigs):
            for j, sj in enumerate(sigs):
                sent, expected = si["splits"]["in"][j], sj["splits"]["out"][i]
                if sent != expected:
                    return (
                        f"rank {global_ranks[i]} sends {sent} rows to rank {global_ranks[j]} in "
                        f"{sigs[0]['op']} at seq {seq} but rank {global_ranks[j]} expects {expected}"
                    )
    return None


def check(group: GroupView, seq: int, sig: dict, timeout_s: float) -> None:
    """Debug-mode pre-collective check. Raises DesyncError / CollectiveTimeout on every member."""
    store, me, n = group.store, group.rank, group.size
    store.set(f"sig/{seq}/{me}", json.dumps(sig))
    keys = [f"sig/{seq}/{m}" for m in range(n)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception:  # the store raises DistStoreError / RuntimeError on timeout
        present = [m for m in range(n) if store.check([keys[m]])]
        raise _timeout_error(group, seq, _desc(sig, False), timeout_s, present, "before it started") from None
    values = store.multi_get(keys) if hasattr(store, "multi_get") else [store.get(k) for k in keys]
    # Everyone has finished reading seq-2 once they all posted seq-1 (which we waited for
    # last time), so our own seq-2 key can go: the store stays small on long runs.
    if seq >= 2:
        store.delete_key(f"sig/{seq - 2}/{me}")
    msg = compare([json.loads(v) for v in values], group.ranks, seq)
    if msg:
        raise DesyncError(f"meshspeed: desync on group {group.name}: {msg}")


HEARTBEAT_S = 0.5  # how often a rank bumps its counter
HEARTBEAT_WINDOW_S = 2.0  # a counter that did not move in this long (4 beats) has stopped
_HB = "meshspeed/hb/"


class Heartbeat:
    """This rank's counter in the store, bumped every HEARTBEAT_S by a thread of its own.

    Not a daemon: a daemon thread caught inside the store's native code when the interpreter
    shuts down is killed mid-call (glibc's forced unwind through C++ frames), which aborts the
    process ("terminate called without an active exception"). This one ends by itself within
    0.1 s of the main thread ending, before shutdown goes on, or when `stop()` is called; it
    also ends when the store stops answering (the job is ending)."""

    def __init__(self, store, rank: int, period_s: float = HEARTBEAT_S):
        self.store, self.key, self.period_s = store, f"{_HB}{rank}", period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="meshspeed-heartbeat", daemon=False)
        self._thread.start()

    def _run(self) -> None:
        main, beat, next_at = threading.main_thread(), 0, 0.0
        while main.is_alive() and not self._stop.is_set():
            if time.monotonic() >= next_at:
                beat += 1
                try:
                    self.store.set(self.key, str(beat))
                except Exception:  # the store's host is gone: nothing left to tell
                    return
                next_at = time.monotonic() + self.period_s
            self._stop.wait(0.1)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)


def _beats(store, world: int) -> list[str | None]:
    keys = [f"{_HB}{r}" for r in range(world)]
    have = [store.check([k]) for k in keys]
    return [store.get(k).decode() if ok else None for k, ok in zip(keys, have)]


def _stalled(before: list, after: list) -> list[int]:
    """Ranks whose counter did not move between two reads (or never appeared)."""
    return [r for r, (a, b) in enumerate(zip(before, after)) if b is None or a == b]


def stalled_ranks(ctx) -> list[int] | None:
    """The ranks whose heartbeat did not move over HEARTBEAT_WINDOW_S (a point-to-point wait's
    root cause: the peer stopped, or something it waits for did), or None when there is no store
    or it did not answer. Bounded as diagnose_timeout's polling is: a daemon thread, abandoned."""
    store, world = getattr(ctx, "store", None), getattr(ctx, "world_size", 0)
    if store is None:
        return None
    found: list = []

    def poll() -> None:
        try:
            before = _beats(store, world)
            time.sleep(HEARTBEAT_WINDOW_S)
            found.append(_stalled(before, _beats(store, world)))
        except Exception:  # noqa: BLE001 - the store is gone: nothing more to say
            pass

    worker = threading.Thread(target=poll, name="meshspeed-diagnose-p2p", daemon=True)
    worker.start()
    worker.join(HEARTBEAT_WINDOW_S + 5.0)
    return found[0] if found else None


def root_cause(stalled: list[int]) -> str:
    """The prefix naming the ranks whose heartbeat stopped, first in a timeout's message."""
    many = len(stalled) > 1
    return (
        f"meshspeed: {'ranks' if many else 'rank'} {_ranks(stalled)} stopped making progress ("
        f"{'their heartbeats' if many else 'its heartbeat'} stopped or never started: stopped, "
        f"frozen, dead, or hung before {'their' if many else 'its'} first collective); "
    )


def diagnose_timeout(
    group: GroupView, seq: int, desc: str, timeout_s: float, cause: str = ""
) -> CollectiveTimeout:
    """Build the timeout error after a collective stalled; names who never arrived.

    `cause`: set when the wait ended early because a peer closed its connection (the backend's
    words). Under load a peer whose deadline passed first gives up and leaves; the ranks still
    waiting on it must report the same cause (who never arrived), not a socket error.

    Bounded: the store lives in one process (rank 0's, or torchrun's agent), and if that
    process is the one that stopped answering (SIGSTOP, a frozen host) every store call would
    block for the store's own, much longer, timeout. The polling runs on a daemon thread and
    is abandoned after the grace period plus a margin: the error then says the store did not
    answer instead of waiting for it."""
    store, me, n = group.store, group.rank, group.size
    if store is None:
        return _timeout_error(group, seq, desc, timeout_s, None, "", cause)
    keys = [f"stuck/{seq}/{m}" for m in range(n)]
    # Members that arrived time out within their arrival skew of each other; wait that long.
    grace = min(max(1.0, 0.5 * timeout_s), 10.0)
    world_store, world = getattr(group.ctx, "store", None), getattr(group.ctx, "world_size", 0)
    found: list = []

    def poll() -> None:
        try:
            store.set(keys[me], desc)
            start = time.monotonic()
            beats = _beats(world_store, world) if world_store is not None else None
            present = [me]
            while time.monotonic() < start + grace:
                present = [m for m in range(n) if store.check([keys[m]])]
                if len(present) == n:
                    break
                time.sleep(0.05)
            stalled = None
            if beats is not None and len(present) < n:  # long enough for every live counter to move
                time.sleep(max(0.0, start + HEARTBEAT_WINDOW_S - time.monotonic()))
                stalled = _stalled(beats, _beats(world_store, world))
            found.append((present, stalled))
        except Exception:  # noqa: BLE001 - the store itself is gone (rank 0 died): say what we know
            found.append((None, None))

    worker = threading.Thread(target=poll, name="meshspeed-diagnose", daemon=True)
    worker.start()
    worker.join(max(grace, HEARTBEAT_WINDOW_S) + 5.0)
    present, stalled = found[0] if found else (None, None)
    return _timeout_error(group, seq, desc, timeout_s, present, "", cause, stalled)


def _timeout_error(
    group, seq, desc, timeout_s, present, when, cause: str = "", stalled: list[int] | None = None
) -> CollectiveTimeout:
    gr = group.ranks
    if cause:  # a peer left before our own deadline: most likely its deadline passed first
        head = (
            f"meshspeed: {desc} on group {group.name} at seq {seq} failed on rank {gr[group.rank]}: "
            f"a peer closed its connection ({cause}): it died, or gave up after its own {timeout_s:g}s"
        )
    else:
        head = (
            f"meshspeed: {desc} on group {group.name} at seq {seq} timed out after {timeout_s:g}s "
            f"{when + ' ' if when else ''}on rank {gr[group.rank]}"
        )
    if present is None:
        who = (
            ": the rendezvous store did not answer, so the missing ranks are unknown (is rank 0, or "
            "torchrun's agent, stopped or dead?)"
        )
    else:
        missing = [gr[m] for m in range(group.size) if m not in present]
        if missing:
            waiting = [gr[m] for m in present]
            who = (
                f": {'rank' if len(missing) == 1 else 'ranks'} {_ranks(missing)} did not arrive "
                f"({'rank' if len(waiting) == 1 else 'ranks'} {_ranks(waiting)} "
                f"{'is' if len(waiting) == 1 else 'are'} waiting in it)"
            )
        else:
            who = ": every rank arrived but the transfer did not finish (network or backend failure?)"
    tail = group.ctx.recorder.format_tail(5)
    dump = group.ctx.dump_trace()
    where = f"\n  full trace: {dump}" if dump else "\n  (set MESHSPEED_TRACE_DIR to dump the full trace)"
    root = ""
    if stalled:  # the root cause first: the rank(s) whose heartbeat stopped
        root = root_cause(stalled)
        head = head.replace("meshspeed: ", "", 1)
    err = CollectiveTimeout(f"{root}{head}{who}\n  last collectives on this rank:\n{tail}{where}")
    err.culprits = list(stalled or [])
    return err
