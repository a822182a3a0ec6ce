"""One owner per run directory: an OS file lock (flock) on `<run dir>/.meshspeed.lock`, taken
before anything is written there and held for the whole run.

The kernel releases the lock when its holder exits, however it exits (SIGKILL and crashes
included), so a dead run never blocks the next one and there is no stale-lock guessing. The
file itself stays (deleting a lock file lets two processes lock two different files); it holds
the owner's pid, host and command so that a second run is told in one line who has the
directory. Locks are advisory: they stop meshspeed runs, not other programs.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

from meshspeed.comm.errors import ConfigError

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no lock, as before
    fcntl = None

LOCK = ".meshspeed.lock"


class RunDirBusy(ConfigError):
    """Another live process holds the run directory's lock; the message names it."""


class RunDirLock:
    """`with RunDirLock(run_dir):` or `lock = RunDirLock(run_dir).acquire()` ... `lock.release()`."""

    def __init__(self, run_dir: str, setting: str = "run.dir", what: str = "meshspeed train"):
        self.run_dir, self.setting, self.what = run_dir, setting, what
        self.path = os.path.join(run_dir, LOCK)
        self.fd: int | None = None

    def acquire(self) -> RunDirLock:
        if fcntl is None or self.fd is not None:
            return self
        os.makedirs(self.run_dir, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            owner = _owner(fd)
            os.close(fd)
            raise RunDirBusy(
                f"{self.setting}={self.run_dir} is in use by {owner}; wait for it to finish (or stop it), "
                f"or choose another {self.setting}"
            ) from None
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "what": self.what,
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
            "argv": sys.argv[1:][:40],
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _owner(fd: int) -> str:
    """Who holds the lock, from what it wrote (it may not have written yet)."""
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        pid, host = int(info["pid"]), str(info["host"])
    except (OSError, ValueError, KeyError, TypeError):
        return "another meshspeed process (it has not said which yet)"
    since = f", since {info['since']}" if isinstance(info.get("since"), str) else ""
    what = info.get("what") if isinstance(info.get("what"), str) else "meshspeed"
    return f"another {what} (pid {pid} on host {host}{since})"
