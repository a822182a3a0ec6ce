"""Run a test function on N gloo ranks, reusing one pool of worker processes per world size.

Spawning processes and forming a gloo group costs seconds; hundreds of distributed checks
would take minutes if each paid it. A pool is started on first use for a world size and kept
for the session. Each job has a timeout: a hang fails the test (and the pool is replaced)
instead of stalling CI. A test function is a module-level `fn(ctx, *args)`; it runs on every
rank with that rank's CommContext and its return values come back as a list indexed by rank.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import queue
import time
import traceback

from meshspeed.comm.launch import free_port, worker_env

# Collectives inside tests time out well before the job does, so a planted hang surfaces as
# meshspeed's own diagnosis; the job timeout is the backstop for everything else.
TEST_COMM_TIMEOUT_S = 20.0
DEFAULT_JOB_TIMEOUT_S = 90.0
POOL_START_S = 240.0
# Jobs reuse the groups of the meshes they build (CommContext caches them): destroying a job's
# groups to make them again in the next job is not safe under torch 2.13 (seen: the rebuilt
# mesh's first new_group failed in connectFullMesh, "Connection closed by peer"; a likely cause:
# torch names DeviceMesh's groups by the count of live groups, so a new one can take a destroyed
# one's name in the store, with its stale addresses). Idle groups once cost a core (torch gives
# each gloo group a transport thread polling every 10 ms: 13% of a core per world-4 worker
# holding 30 groups); meshspeed's groups now share one (comm/gloo_transport.py) and an idle
# worker costs about 1% of a core, so pools live for the session. A pool whose workers hold more
# than MAX_GROUPS groups is still replaced after its job (each group keeps sockets and two
# threads), and one no test has used for IDLE_S is stopped.
MAX_GROUPS = 128
IDLE_S = 600.0


def _process_groups() -> int:
    """How many process groups torch holds in this process (its private registry; 0 where a
    torch lacks it, and then pools are never recycled)."""
    from torch.distributed import distributed_c10d as c10d

    return len(getattr(getattr(c10d, "_world", None), "pg_map", None) or ())


def _worker(rank: int, ws: int, port: int, inq, outq) -> None:
    os.environ.update(worker_env(rank, ws, port))
    os.environ["MESHSPEED_LINK_PARAMS"] = "none"  # built-in defaults: the same choices everywhere
    os.environ.pop("MESHSPEED_ALGO", None)
    os.environ.pop("MESHSPEED_DEBUG", None)
    import torch

    from meshspeed import comm

    torch.set_num_threads(1)
    ctx = comm.init("gloo", timeout_s=TEST_COMM_TIMEOUT_S)
    outq.put((rank, "ready", None))
    while True:
        job = inq.get()
        if job is None:
            break
        fn, args, overrides = job
        saved = {k: getattr(ctx, k) for k in overrides}
        try:
            for k, v in overrides.items():
                setattr(ctx, k, v)
            value = fn(ctx, *args)
            result = (rank, "ok", (value, _process_groups()))  # the groups: for MAX_GROUPS
        except BaseException:  # noqa: BLE001 - the parent turns this into the test failure
            result = (rank, "err", traceback.format_exc())
        finally:
            for k, v in saved.items():
                setattr(ctx, k, v)
        outq.put(result)
    ctx.close()


def context():
    """Workers are forked from a server that imported torch and meshspeed once: a spawned worker
    imports them itself (~7 s of CPU each here), and a pool start cost a world-4 job ~15-40 s."""
    mctx = mp.get_context("forkserver")
    # torch's import starts no thread and no device runtime, so forking after it is safe (the
    # path torch's own DataLoader workers take); each worker then builds its own gloo groups
    # (and what nearly every test module and launched command pulls in: DTensor, DCP, the
    # trainer and matplotlib for its loss curve, 4-7 s of CPU per process otherwise, paid again
    # by each rank of each new pool and by each command tests/warm.py starts)
    mctx.set_forkserver_preload(
        ["torch", "torch.distributed", "meshspeed.comm", "tests.harness", "pytest",
         "torch.distributed.tensor", "torch.distributed.checkpoint", "meshspeed.train.trainer",
         "meshspeed.cli", "matplotlib.figure", "matplotlib.backends.backend_agg"]
    )
    return mctx


class Pool:
    def __init__(self, ws: int):
        mctx = context()
        self.ws = ws
        self.outq = mctx.Queue()
        self.inqs = [mctx.Queue() for _ in range(ws)]
        port = free_port()
        self.procs = [
            mctx.Process(target=_worker, args=(r, ws, port, self.inqs[r], self.outq), daemon=True)
            for r in range(ws)
        ]
        for p in self.procs:
            p.start()
        # a bound on a hang, not a speed claim: each rank imports torch and meshspeed (~10 s of
        # CPU each on the 2-core CI machine), four at once, beside whatever else is running
        self._collect(POOL_START_S, "start")
        self.last_use = time.monotonic()

    def _collect(self, timeout: float, what: str) -> list:
        results: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout
        first_err = None
        while len(results) < self.ws:
            # Once one rank failed, the rest get a short grace: they are often stuck in a
            # collective the failed rank will never join.
            limit = min(deadline, first_err + 5.0) if first_err else deadline
            try:
                rank, status, value = self.outq.get(timeout=max(0.01, limit - time.monotonic()))
            except queue.Empty:
                break
            results[rank] = (status, value)
            if status == "err" and first_err is None:
                first_err = time.monotonic()
        missing = [r for r in range(self.ws) if r not in results]
        errs = {r: v for r, (s, v) in results.items() if s == "err"}
        if missing or errs:
            self.kill()
            lines = []
            seen = set()
            for r, tb in sorted(errs.items()):
                last = tb.strip().splitlines()[-1]
                if last in seen:
                    lines.append(f"--- rank {r}: same error: {last}")
                    continue
                seen.add(last)
                lines.append(f"--- rank {r}:\n{tb}")
            if missing:
                lines.append(f"--- ranks {missing} did not finish {what} within {timeout:g}s (pool replaced)")
            raise AssertionError("\n".join(lines))
        return [results[r][1] for r in range(self.ws)]

    def run(self, fn, args: tuple, overrides: dict, timeout: float) -> list:
        for q in self.inqs:
            q.put((fn, args, overrides))
        out, groups = zip(*self._collect(timeout, fn.__name__))
        self.last_use = time.monotonic()
        if max(groups) > MAX_GROUPS:
            self.kill()  # the next job starts a fresh pool
        return list(out)

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)
        _POOLS.pop(self.ws, None)


_POOLS: dict[int, Pool] = {}


def run(
    ws: int, fn, *args, timeout: float = DEFAULT_JOB_TIMEOUT_S, fresh_after: bool = False, **overrides
) -> list:
    """Run `fn(ctx, *args)` on `ws` ranks; returns the per-rank results.

    `overrides` set CommContext attributes for this job only (debug=True, timeout_s=2, ...).
    `fresh_after` discards the pool afterwards (for tests that leave a group mid-collective).
    """
    pool = _POOLS.get(ws)
    if pool is None or not pool.alive():
        pool = _POOLS[ws] = Pool(ws)
    try:
        return pool.run(fn, args, overrides, timeout)
    finally:
        if fresh_after:
            pool.kill()


def stop_idle_pools(everything: bool = False) -> None:
    """Stop the pools no job has used for IDLE_S, or all of them (called before each test)."""
    for pool in list(_POOLS.values()):
        if everything or time.monotonic() - pool.last_use > IDLE_S:
            pool.kill()


@atexit.register
def _shutdown() -> None:
    for pool in list(_POOLS.values()):
        for q in pool.inqs:
            q.put(None)
        for p in pool.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
