"""The launcher forks CPU workers when that is safe, and a forked job fails as a spawned one does.

Forking skips each worker's import of torch and meshspeed (about 8 s of CPU on 2 cores). It is
safe only from a single-threaded process (an OpenMP pool copied half-alive hangs the child),
and a forked worker inherits what a spawned one never has: the launcher's signal handlers and
the other ranks' pipe ends. Each job runs in a fresh process, bounded by a subprocess timeout.
"""

from __future__ import annotations

import subprocess
import sys

from tests.faults import procs


def _job(case: str) -> subprocess.CompletedProcess:
    env = procs.env()
    env["OPENBLAS_NUM_THREADS"] = "1"  # as meshspeed's __main__ sets it for its launcher
    return subprocess.run(
        [sys.executable, "-m", "tests.faults.fork_jobs", case],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )


def test_fork_only_when_allowed_and_single_threaded():
    out = _job("method")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["fork", "spawn", "spawn"]


def test_a_forked_worker_that_dies_silently_is_named_while_its_peer_still_runs():
    # The peer sleeps 120 s, past the 90 s bound: only the dead rank's pipe reaching EOF (no
    # other worker holding a copy of its end) lets the launcher see the death and stop the job.
    out = _job("silent_exit")
    assert out.returncode == 1, out.stderr[-2000:]
    assert "rank 1: the launcher" in out.stdout  # forked, not spawned: it saw the launcher's global
    assert "rank 1 exited with code 3 without reporting an error" in out.stderr.splitlines()[-1]


def test_a_forked_worker_has_the_default_signal_handlers():
    out = _job("handlers")
    assert out.returncode == 0, out.stderr[-2000:]
    assert sorted(out.stdout.splitlines()) == [
        "rank 0: the launcher, handlers default",
        "rank 1: the launcher, handlers default",
    ]
