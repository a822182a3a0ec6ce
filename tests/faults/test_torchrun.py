"""A real torchrun restart: a worker is SIGKILLed mid-run and `--max-restarts 1` with
`--checkpoint.resume auto` finishes the run from the newest checkpoint.

torch's elastic agent keeps its store across restarts, so the restarted workers would find
the dead attempt's keys (gloo's peer addresses) and connect to processes that no longer
exist; meshspeed gives each attempt its own store prefix (comm.context._elastic_store).
"""

from __future__ import annotations

import os
import signal

from meshspeed.checkpoint import dcp as ckpt
from meshspeed.checkpoint import manifest
from tests.faults.procs import FAST, metrics

STEPS = 60


def test_torchrun_restart_after_a_killed_worker_finishes_the_run(start, tmp_path):
    run = tmp_path / "run"
    job = start(
        FAST
        + [
            "--parallel.tp",
            "2",
            "--train.steps",
            str(STEPS),
            "--checkpoint.interval",
            "2",
            "--checkpoint.resume",
            "auto",
            "--run.dir",
            str(run),
        ],
        torchrun=["--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.2"],
    )
    workers = job.workers(2, timeout=120)
    job.wait_for("a checkpoint", lambda: len(ckpt.list_checkpoints(str(run))) >= 2, timeout=120)
    os.kill(workers[1], signal.SIGKILL)
    assert job.finish(240) == 0, job.stderr[-4000:]
    out = job.stdout
    assert "checkpoint.resume=auto: no checkpoint" in out  # attempt 0 started fresh
    resumed = [ln for ln in out.splitlines() if ln.startswith("meshspeed: resumed from step")]
    assert len(resumed) == 1, out[-2000:]  # attempt 1 resumed (rank 0 says it once)
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(STEPS))  # every step once, as one run
    final = run / f"step-{STEPS:06d}"
    assert final.is_dir() and manifest.verify(str(final)) is None
