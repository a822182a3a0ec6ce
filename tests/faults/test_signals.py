"""Faults from outside the process, as a cluster produces them: a killed worker, a killed
launcher, an I/O error on one rank (a stopped rank: test_root_cause.py, one job for both claims).
Each job is bounded: a hang fails the test.

The bound for a stopped rank is the collective timeout plus 60 s (the acceptance of issue 9);
for an error or a death, 60 s. Neither is a speed claim: a job that needs them is hanging.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.faults.procs import COMM_TIMEOUT, FAST

LONG = FAST + ["--train.steps", "2000", "--run.timeout", str(COMM_TIMEOUT)]


def test_killed_worker_is_named_with_its_signal(start, tmp_path):
    run = tmp_path / "run"
    job = start(LONG + ["--nproc", "2", "--run.dir", str(run)])
    workers = job.workers(2)
    job.wait_rows(run, 2)
    os.kill(workers[1], signal.SIGKILL)
    assert job.finish(60) == 1
    assert "rank 1 was killed by SIGKILL (exit -9): out of memory?" in job.last_line(), job.stderr[-2000:]
    assert not job.gone(workers)


def test_error_on_one_rank_ends_every_rank(start, tmp_path):
    """Rank 0 alone writes metrics.jsonl; make that write fail (a directory where the file was:
    permissions would not stop root) and the whole job must end, naming rank 0 and the error."""
    run = tmp_path / "run"
    job = start(LONG + ["--nproc", "2", "--parallel.tp", "2", "--run.dir", str(run)])
    workers = job.workers(2)
    job.wait_rows(run, 2)
    metrics = run / "metrics.jsonl"
    os.rename(metrics, run / "metrics.moved")
    os.mkdir(metrics)
    assert job.finish(60) == 1
    line = job.last_line()
    assert line.startswith("meshspeed: rank 0 failed: IsADirectoryError") and "metrics.jsonl" in line, line
    assert "Traceback" in job.stderr  # not a diagnosis meshspeed made: the traceback comes with it
    assert not job.gone(workers)


# SIGINT takes SIGTERM's path through the launcher: `slow`, to keep the suite's time
@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow), signal.SIGKILL]
)
def test_killed_launcher_leaves_no_worker(start, tmp_path, sig):
    run = tmp_path / "run"
    job = start(LONG + ["--nproc", "2", "--parallel.tp", "2", "--run.dir", str(run)])
    workers = job.workers(2)
    if sig == signal.SIGTERM:  # mid-training; the others while the workers start (cheaper, same path)
        job.wait_rows(run, 1)
    else:
        time.sleep(2)
    os.kill(job.proc.pid, sig)
    code = job.finish(60)
    assert code == (-9 if sig == signal.SIGKILL else 128 + sig), job.stderr[-2000:]
    assert job.gone(workers) == [], "orphaned workers"  # SIGKILL: the kernel kills them (PDEATHSIG)
    if sig != signal.SIGKILL:
        assert f"stopped by {sig.name}; all 2 workers stopped" in job.last_line()
