"""Spawn N local worker processes that form one job (when not launched by torchrun).

Each worker gets the same environment torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so code inside is identical under both. A failure
is reported once, as one line per distinct message, instead of a traceback from every rank.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import time
import traceback

from meshspeed.comm.errors import CommError, ConfigError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    # Oversubscribed cores make every rank slower than one: split the cores between workers.
    threads = max(1, (os.cpu_count() or 1) // nproc)
    return {
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(nproc),
        "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(nproc), "OMP_NUM_THREADS": str(threads),
    }


def _entry(fn, args, rank, nproc, port, env, errq):
    os.environ.update(worker_env(rank, nproc, port))
    os.environ.update(env or {})
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        fn(*args)
    except (ConfigError, CommError) as err:
        errq.put((rank, "clear", str(err)))
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    except BaseException as err:  # noqa: BLE001 - reported to the parent, then exit non-zero
        if isinstance(err, SystemExit) and not err.code:
            return
        errq.put((rank, "crash", traceback.format_exc()))
        sys.exit(1)


def _ranks(rs: list[int]) -> str:
    rs = sorted(rs)
    return f"{rs[0]}-{rs[-1]}" if len(rs) > 1 and rs == list(range(rs[0], rs[-1] + 1)) else ",".join(map(str, rs))


def spawn(fn, nproc: int, args: tuple = (), *, env: dict[str, str] | None = None, grace_s: float = 10.0) -> int:
    """Run `fn(*args)` in `nproc` fresh processes forming one job; return an exit code.

    `fn` must be importable (a module-level function). When a worker fails the others get
    `grace_s` to fail on their own (usually with a clearer collective-timeout message), then
    are terminated.
    """
    if nproc < 1:
        raise ConfigError(f"--nproc={nproc} must be ≥ 1")
    mctx = mp.get_context("spawn")
    errq = mctx.SimpleQueue()
    port = free_port()
    procs = [mctx.Process(target=_entry, args=(fn, args, r, nproc, port, env, errq), daemon=False)
             for r in range(nproc)]
    for p in procs:
        p.start()
    failed_at = None
    try:
        while any(p.is_alive() for p in procs):
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > grace_s:
                for p in procs:
                    if p.is_alive():
                        p.terminate()
            time.sleep(0.05)
    except KeyboardInterrupt:
        for p in procs:
            p.terminate()
        raise
    for p in procs:
        p.join()
    errors = []
    while not errq.empty():
        errors.append(errq.get())
    return _report(errors, [p.exitcode for p in procs])


def _report(errors: list[tuple], codes: list[int]) -> int:
    if all(c == 0 for c in codes):
        return 0
    by_msg: dict[str, list[int]] = {}
    for rank, kind, msg in errors:
        by_msg.setdefault(msg, []).append(rank)
    shown_crash = False
    for msg, ranks in sorted(by_msg.items(), key=lambda kv: min(kv[1])):
        if "Traceback" in msg:
            if shown_crash:  # one traceback is enough; the rest are usually its echoes
                continue
            shown_crash = True
        print(f"meshspeed: rank {_ranks(ranks)}: {msg.rstrip()}", file=sys.stderr)
    if not errors:
        print(f"meshspeed: workers exited with codes {codes}", file=sys.stderr)
    return 1
