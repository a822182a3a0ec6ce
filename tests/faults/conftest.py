"""Fault-injection fixtures: every job a test starts is SIGKILLed (whole session) when it ends."""

import pytest

from tests.faults.procs import Job


@pytest.fixture
def start(tmp_path):
    jobs = []

    def _start(args, **kw):
        job = Job(tmp_path, args, name=f"job{len(jobs)}", **kw)
        jobs.append(job)
        return job

    yield _start
    for job in jobs:
        job.kill_all()
