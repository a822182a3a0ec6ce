"""Root cause first (issue 31): when a rank stops (SIGSTOP), the ranks waiting for it time out in
different groups, and the first to report may be one waiting for a rank that is itself waiting
(rank 0 waits for rank 2 in dp while rank 2 waits for the stopped rank 3 in tp). Every rank's
heartbeat counter in the store tells them apart: the job's last line must name the stopped rank
as the one that stopped making progress, not the first rank found waiting. A real job, a real
signal, a bounded wait (the timeout plus 60 s: a bound on a hang, not a speed claim)."""

from __future__ import annotations

import os
import re
import signal

from tests.faults.procs import FAST

# Start-up on a loaded 2-core machine (each worker imports torch) can take minutes: a bound
# on a hang, not a speed claim.
BOUND = 600

STOP_TIMEOUT = 15  # MESHSPEED_TIMEOUT: long enough for gloo to connect on a loaded machine


def test_stopped_rank_is_named_as_the_root_cause(start, tmp_path):
    run = tmp_path / "run"
    job = start(
        FAST + ["--train.steps", "2000", "--nproc", "4", "--parallel.tp", "2", "--run.dir", str(run)],
        extra_env={"MESHSPEED_TIMEOUT": str(STOP_TIMEOUT)},
    )  # dp 2 x tp 2: rank 3's tp peer is rank 2, its dp peer rank 1
    workers = job.workers(4, timeout=BOUND)
    job.wait_rows(run, 2, timeout=BOUND)
    os.kill(workers[3], signal.SIGSTOP)
    assert job.finish(STOP_TIMEOUT + 60) != 0
    line = job.last_line()
    # e.g. "meshspeed: rank 3 stopped making progress (its heartbeat stopped or never started: ...);
    # all_reduce(...) on group dp[0,2] at seq 41 timed out after 5s on rank 0: rank 2 did not
    # arrive (rank 0 is waiting in it) (reported by rank 0) (the other 3 workers were stopped)"
    assert line.startswith("meshspeed: rank 3 stopped making progress ("), line
    assert f"timed out after {STOP_TIMEOUT}s" in line, line
    # ... and the collective that timed out, with its group and the rank it waited for
    assert re.search(r"on group (tp|dp|world|dp_cp)\S* at seq \d+ timed out", line), line
    assert re.search(r"ranks? [\d,]+ did not arrive", line), line
    assert not job.gone(workers), "a worker outlived the job"
