"""`meshspeed run` leaves nothing behind and says what it waits for (issue 44, item 7): what a
worker starts (a `sleep` grandchild) is stopped when the job ends, on success and when a rank
raises (before, it outlived the job and `meshspeed run ... | cat` waited for it); a rank still
running after its peers finished is named; an --nproc the machine cannot hold is one line
before any worker starts. Real processes, each job bounded by a subprocess timeout."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time

import pytest

from meshspeed import cli
from meshspeed.comm import launch
from tests import warm
from tests.faults.procs import alive, env

BOUND = 300  # seconds for a whole job: start, run, stop (a hang guard, not a speed claim)

# Each rank starts a grandchild that would sleep for ten minutes, holding the job's stdout.
GRANDCHILD = """
import os, subprocess, sys
import torch.distributed as dist

rank = int(os.environ["RANK"])
kid = subprocess.Popen(["sleep", "600"])
with open(f"kid-{rank}", "w") as f:
    f.write(str(kid.pid))
dist.init_process_group("gloo")
dist.barrier()  # both grandchildren exist before either rank ends
if sys.argv[1] == "raise" and rank == 1:
    raise ValueError("rank 1 gives up")
if sys.argv[1] == "raise":
    dist.barrier()  # rank 0 waits for a rank 1 that never comes: the launcher stops it
print(f"rank {rank} done", flush=True)
"""


def _kids(tmp_path) -> list[int]:
    return [int((tmp_path / f"kid-{r}").read_text()) for r in range(2)]


@pytest.mark.parametrize("mode, code", [("ok", 0), ("raise", 1)])
def test_what_a_worker_started_ends_with_the_job(start, tmp_path, mode, code):
    (tmp_path / "kids.py").write_text(textwrap.dedent(GRANDCHILD))
    job = start(["--nproc", "2", "kids.py", mode], command="run")
    try:
        assert job.finish(BOUND) == code, job.stderr[-3000:]
        if mode == "raise":
            assert job.last_line().startswith("meshspeed: rank 1 failed: ValueError: rank 1 gives up")
        # the launcher returns only after its workers' groups are empty (SIGKILL after the grace)
        assert not [p for p in _kids(tmp_path) if alive(p)], "a grandchild outlived the job"
    finally:  # a failing test leaks nothing either
        for r in range(2):
            kid = tmp_path / f"kid-{r}"
            if kid.exists() and alive(int(kid.read_text())):
                os.kill(int(kid.read_text()), signal.SIGKILL)


def test_a_rank_still_running_after_its_peers_is_named(tmp_path):
    code = (
        "import sys; from meshspeed.comm import launch; from tests.faults import run_jobs; "
        "sys.exit(launch.spawn(run_jobs.linger, 2, straggler_s=1.0, fork_ok=True))"
    )
    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "w") as o, open(err, "w") as e:
        proc = warm.popen(
            [sys.executable, "-c", code], stdout=o, stderr=e, env=env(), cwd=tmp_path, start_new_session=True
        )
    line = (
        "meshspeed: rank 1 is still running 1 s after the other worker finished; waiting "
        "(Ctrl-C or SIGTERM stops the job)"
    )
    try:
        deadline = time.monotonic() + BOUND
        while line not in err.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert line in err.read_text(), err.read_text()[-3000:]
        assert proc.poll() is None, "the job must keep waiting for the rank"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=BOUND) == 128 + signal.SIGTERM, err.read_text()[-3000:]
        assert (
            err.read_text().strip().splitlines()[-1] == "meshspeed: stopped by SIGTERM; all 2 workers stopped"
        )
        assert not alive(int((tmp_path / "pid-1").read_text()))
    finally:
        if proc.poll() is None:
            proc.kill()


def test_more_workers_than_the_machine_holds_is_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "ok.py").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MESHSPEED_MAX_WORKERS", raising=False)
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("a worker was started"))
    most, why = launch.max_workers()
    assert cli.main(["run", "--nproc", str(most + 1), "ok.py"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"meshspeed run: --nproc={most + 1} is more workers than this machine holds (at most {most}: {why}); "
        f"use --nproc {most} or fewer, or set MESHSPEED_MAX_WORKERS={most + 1} to start them anyway"
    ), err
    monkeypatch.setenv("MESHSPEED_MAX_WORKERS", str(most + 1))  # the override lets it through
    monkeypatch.setattr(launch, "spawn", lambda fn, n, *a, **k: 0 if n == most + 1 else 1)
    assert cli.main(["run", "--nproc", str(most + 1), "ok.py"]) == 0


# meshspeed.comm.init() then plain torch.distributed: rank 2 never comes to the all_reduce.
ABSENT = """
import os, time
import torch
import torch.distributed as dist
from meshspeed import comm

ctx = comm.init()
with open(f"pid-{ctx.rank}", "w") as f:
    f.write(str(os.getpid()))
if ctx.rank == 2:
    time.sleep(600)
dist.all_reduce(torch.ones(4))
"""


def test_a_plain_collective_timeout_names_the_rank_that_never_arrived(start, tmp_path):
    """Before: "rank 1 failed: RuntimeError: ... Timed out waiting 5000ms ..." (rank 1 only
    waited; rank 2, still running without an error, was the cause)."""
    (tmp_path / "absent.py").write_text(textwrap.dedent(ABSENT))
    job = start(["--nproc", "3", "absent.py"], command="run", extra_env={"MESHSPEED_TIMEOUT": "5"})
    assert job.finish(BOUND) == 1, job.stderr[-3000:]
    line = job.last_line()
    assert line.startswith("meshspeed: rank 2 never arrived (still running, no error) where rank "), line
    assert "Timed out waiting 5000ms" in line and line.endswith("(the other 2 workers were stopped)"), line
    assert not alive(int((tmp_path / "pid-2").read_text()))


def test_meshspeed_train_takes_the_same_bound(tmp_path, monkeypatch, capsys):
    """`meshspeed train --nproc N` starts N workers through the same launcher: the same line."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MESHSPEED_MAX_WORKERS", "2")
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("a worker was started"))
    assert cli.main(["train", "--nproc", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "meshspeed train: --nproc=4 is more workers than this machine holds (at most 2: "
        "MESHSPEED_MAX_WORKERS=2); use --nproc 2 or fewer, or set MESHSPEED_MAX_WORKERS=4 to start "
        "them anyway"
    ), err
    assert not (tmp_path / "runs").exists()  # checked before the run directory is touched
