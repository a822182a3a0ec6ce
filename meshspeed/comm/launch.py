"""Spawn N local worker processes that form one job (when not launched by torchrun), and watch them.

Each worker gets the same environment torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so code inside is identical under both.

Failure is designed, not left to chance:
- a worker that raises reports the error to the launcher through its own pipe (a shared queue
  has a lock, and a worker killed while holding it would silence every other worker) and exits
  at once, without waiting in a barrier or a `close()` for peers that will never come;
- the launcher watches every worker; when one fails or dies it sends the others SIGTERM (and
  SIGCONT, so a stopped one can act on it), then SIGKILL after a grace period, and its last
  line names the first rank that failed and why: the exception's message, or the signal;
- killing the launcher (SIGINT, SIGTERM, SIGHUP) stops every worker, and on Linux a worker
  whose launcher dies even by SIGKILL is killed by the kernel (PR_SET_PDEATHSIG): no orphans;
- each worker leads its own process group, and whatever it started (a data server, a `sleep`
  in a shell) is stopped with it when the job ends, however it ends: a grandchild left running
  would hold the job's stdout open (`meshspeed run ... | cat` would wait for it);
- a plain torch.distributed timeout (no meshspeed diagnosis: it knows no culprit) names the
  ranks still running without an error, the ones the waiting ranks waited for;
- a rank still running well after its peers finished is named (the job waits for it: a rank 0
  saving or evaluating after the others is normal, a stuck one is not silent).

Under torchrun, `run_worker` gives the same one-line report from the rank that failed.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
import traceback

from meshspeed.comm.errors import ConfigError
from meshspeed.comm.watch import STRAGGLER_S, Watch, conclude, end_groups, signal_name, when

_Watch, _when = Watch, when  # the names tests/faults/test_failure_ordering.py reaches through launch

# Signals a launcher passes on to its workers (SIGINT arrives as KeyboardInterrupt).
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    # Oversubscribed cores make every rank slower than one: split the cores between workers.
    threads = max(1, (os.cpu_count() or 1) // nproc)
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(nproc),
        "OMP_NUM_THREADS": str(threads),
    }


# Local workers per core and memory per worker a machine is taken to hold: past them, a job
# starts hundreds of processes and exhausts memory before any of them runs (1,000 workers on 2
# cores: ~294 started and 15 GB gone before the launcher gave up).
WORKERS_PER_CORE = 8
WORKER_MIB = 256


def max_workers() -> tuple[int, str]:
    """(the most local workers this machine holds, how that was decided): MESHSPEED_MAX_WORKERS
    if set, else the smaller of WORKERS_PER_CORE per core and one per WORKER_MIB available."""
    raw = os.environ.get("MESHSPEED_MAX_WORKERS")
    if raw:
        try:
            n = int(raw)
        except ValueError:
            n = 0
        if n < 1:
            raise ConfigError(f"MESHSPEED_MAX_WORKERS={raw} must be a whole number ≥ 1; e.g. 64")
        return n, f"MESHSPEED_MAX_WORKERS={n}"
    cores = os.cpu_count() or 1
    n, why = WORKERS_PER_CORE * cores, f"{cores} cores × {WORKERS_PER_CORE}"
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(ln.split()[1]) for ln in f if ln.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return n, why
    by_memory = max(1, kib // 1024 // WORKER_MIB)
    if by_memory < n:
        n, why = by_memory, f"{kib / 2**20:.1f} GiB available / {WORKER_MIB} MiB per worker"
    return n, why


def check_workers(nproc: int, flag: str = "--nproc") -> None:
    """One line, before anything starts, when `nproc` local workers exceed what the machine holds."""
    most, why = max_workers()
    if nproc > most:
        raise ConfigError(
            f"{flag}={nproc} is more workers than this machine holds (at most {most}: {why}); use "
            f"{flag} {most} or fewer, or set MESHSPEED_MAX_WORKERS={nproc} to start them anyway"
        )


# -- the worker side ------------------------------------------------------------------------
def headline(err: BaseException) -> str:
    """One line saying what went wrong: a clear error's own first line, else `Type: message`."""
    text = str(err).strip()
    first = text.splitlines()[0] if text else ""
    if first.startswith("meshspeed: "):
        first = first[len("meshspeed: ") :]
    if getattr(err, "one_line", False) and first:
        return first
    return f"{type(err).__name__}: {first}" if first else type(err).__name__


def describe_error(err: BaseException) -> tuple[str, str]:
    """(headline, detail): detail is the whole message for a clear error (a timeout's flight
    recorder tail, say), else the traceback; a bug needs its traceback to be found."""
    if getattr(err, "one_line", False):
        return headline(err), str(err).strip()
    return headline(err), "".join(traceback.format_exception(type(err), err, err.__traceback__)).rstrip()


def _die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL this worker when its launcher dies, however it dies (Linux)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the launcher died before the request took effect
        os._exit(1)


def _exit_now(code: int) -> None:
    """Leave without interpreter teardown: joining threads stuck on dead peers, or destroying
    process groups mid-collective, is how a failed rank hangs or aborts on its way out."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def run_worker(fn, args: tuple = (), report=None) -> int:
    """Run `fn(*args)` as one rank of a job; on an exception exit at once with a report.

    `report` (a pipe end, from `spawn`) receives (headline, detail, echo) for the launcher to
    print; without one (under torchrun) the rank prints them itself: one line for a clear
    error, or the traceback and then the line for anything else, and nothing for an echo of
    another rank's failure (`err.echo`, see errors.echo). Returns 0 when `fn` returns."""
    try:
        fn(*args)
    except KeyboardInterrupt:
        _exit_now(130)
    except SystemExit as err:
        if err.code in (None, 0):
            return 0
        _exit_now(err.code if isinstance(err.code, int) else 1)
    except BaseException as err:  # noqa: BLE001 - every failure ends this rank now, reported
        line, detail = describe_error(err)
        is_echo = bool(getattr(err, "echo", False))
        culprits = list(getattr(err, "culprits", None) or [])  # a timeout's root cause (desync.py)
        if report is not None:
            # when: the clock is the machine's (CLOCK_MONOTONIC), so the launcher can order reports
            # that reach it in one poll; a rank that fails because its peer's exit closed their
            # connection reports after that peer
            with contextlib.suppress(Exception):
                report.send((line, detail, is_echo, culprits, time.monotonic()))
        elif not is_echo:
            if detail != line:
                print(detail, file=sys.stderr)
            print(f"meshspeed: rank {os.environ.get('RANK', '0')}: {line}", file=sys.stderr)
        _exit_now(1)
    return 0


def _entry(fn, args, rank, nproc, port, env, report, parent_pid, others=()):
    _die_with_parent(parent_pid)
    # A process group of its own: what this rank starts can be stopped with it (spawn's end_groups).
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    if others:  # forked: the launcher's signal handlers and the other ranks' pipe ends came along
        for s in _STOP_SIGNALS:
            signal.signal(s, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for c in others:  # a copy of rank r's send end kept here would hide r's death (EOF)
            c.close()
    os.environ.update(worker_env(rank, nproc, port))
    os.environ.update(env or {})
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    run_worker(fn, args, report)
    # fn returned: end communication in order (comm.group.teardown) before the interpreter's
    # own shutdown, which would destroy the process groups and their threads in any order.
    from meshspeed.comm.group import teardown

    teardown()
    report.close()


# -- the launcher side ----------------------------------------------------------------------
class _Stopped(Exception):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _signals_raise():
    """Turn SIGTERM/SIGHUP into an exception in the launcher's loop, so it stops its workers
    instead of dying and leaving them behind."""

    def handler(signum, frame):
        raise _Stopped(signum)

    saved = {}
    try:
        for s in _STOP_SIGNALS:
            saved[s] = signal.signal(s, handler)
    except ValueError:  # not the main thread: the caller handles its own signals
        pass
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def _single_threaded() -> bool:
    """True when this process has one OS thread (Linux): only then is fork safe. An OpenMP pool
    started by a CPU op, or CUDA's own threads, would be copied half-alive into the children."""
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:  # not Linux: spawn
        return False


def start_method(fork_ok: bool, preload: tuple[str, ...] = ()) -> str:
    """'fork' when the caller allows it (a CPU job) and this process is single-threaded after
    importing `preload`, else 'spawn'. Forking skips every worker's own import of torch and
    meshspeed: about 8 s of CPU each on 2 cores, where a tiny job's steps take a second."""
    if not fork_ok:
        return "spawn"
    for name in preload:
        importlib.import_module(name)
    return "fork" if _single_threaded() else "spawn"


def spawn(
    fn,
    nproc: int,
    args: tuple = (),
    *,
    env: dict[str, str] | None = None,
    grace_s: float = 5.0,
    fork_ok: bool = False,
    preload: tuple[str, ...] = (),
    straggler_s: float | None = None,
) -> int:
    """Run `fn(*args)` in `nproc` processes forming one job; return an exit code.

    `fn` must be importable (a module-level function). When a worker fails or dies the others
    are sent SIGTERM, then SIGKILL after `grace_s`; the last line printed names the first rank
    that failed and why. SIGINT/SIGTERM/SIGHUP to the launcher stop every worker.

    Workers are fresh interpreters, unless `fork_ok` (the job never touches a GPU) and this
    process is single-threaded once `preload` is imported: then they are forked from it, and
    share its imports (see `start_method`).

    A rank still running `straggler_s` (default STRAGGLER_S) after all others exited cleanly is
    named in one line; the job keeps waiting for it. When the job ends, whatever a worker
    started is stopped too (each worker's process group: SIGTERM, SIGKILL after `grace_s`).
    """
    straggler_s = STRAGGLER_S if straggler_s is None else straggler_s
    if nproc < 1:
        raise ConfigError(f"--nproc={nproc} must be ≥ 1")
    method = start_method(fork_ok, preload)
    mctx = mp.get_context(method)
    port = free_port()
    procs, conns, sends = [], [], []
    pipes = [mctx.Pipe(duplex=False) for _ in range(nproc)]
    for r, (recv, send) in enumerate(pipes):
        # A forked worker closes every pipe end but its own send end (spawn passes only that).
        others = tuple(c for pair in pipes for c in pair if c is not send) if method == "fork" else ()
        procs.append(
            mctx.Process(
                target=_entry, args=(fn, args, r, nproc, port, env, send, os.getpid(), others), daemon=False
            )
        )
        conns.append(recv)
        sends.append(send)
    watch = Watch(procs, conns, grace_s)
    try:
        with _signals_raise():
            for p in procs:
                p.start()
            for s in sends:  # the workers hold their ends; ours would keep EOF from arriving
                s.close()
            while watch.alive():
                watch.poll()
                if watch.first is not None:
                    watch.stop()
                    watch.escalate()
                else:
                    watch.straggler(nproc, straggler_s)
                time.sleep(0.05)
            watch.poll()
            for p in procs:
                p.join()
            end_groups(procs, grace_s)
    except (_Stopped, KeyboardInterrupt) as err:
        signum = err.signum if isinstance(err, _Stopped) else int(signal.SIGINT)
        watch.wait_all()
        for p in procs:  # reaped: a worker's group then holds only what it started
            if p.pid is not None:
                p.join()
        end_groups(procs, grace_s)
        print(f"meshspeed: stopped by {signal_name(signum)}; all {nproc} workers stopped", file=sys.stderr)
        return 128 + signum
    return conclude(watch, nproc)
