"""tests/warm.py starts `python -m meshspeed` forked from a warm server; what a test sees of the
command (exit code, both streams, the files it writes relative to its working directory, the
environment it was given) must be what a cold `python -m meshspeed` gives."""

from __future__ import annotations

import os
import sys

from tests import warm


def test_a_warm_command_is_indistinguishable_from_a_cold_one(tmp_path):
    # bad input: exit 2 and one line, decided after the settings file in cwd and the env are read
    (tmp_path / "bad.toml").write_text("[train]\nsteps = 0\n")
    cmd = [sys.executable, "-m", "meshspeed", "train", "--config", "bad.toml", "--nproc", "1"]
    env = {**os.environ, "MESHSPEED_TIMEOUT": "-1"}
    cold = warm.run(cmd, cwd=tmp_path, env=env, timeout=120, cold=True)
    hot = warm.run(cmd, cwd=tmp_path, env=env, timeout=120)
    assert cold.returncode == 2, cold.stderr
    assert (hot.returncode, hot.stdout, hot.stderr) == (cold.returncode, cold.stdout, cold.stderr)


def test_a_warm_command_reports_exit_codes_signals_and_timeouts(tmp_path):
    import signal
    import subprocess
    import time

    import pytest

    ok = warm.run([sys.executable, "-m", "meshspeed", "--help"], cwd=tmp_path, timeout=60)
    assert ok.returncode == 0 and "train" in ok.stdout
    # a Popen-like process: a signal ends it with -signal, as subprocess reports it
    out = tmp_path / "o"
    with open(out, "w") as f:
        proc = warm.popen(
            [sys.executable, "-m", "tests.sleeper"],
            stdout=f, stderr=f, cwd=tmp_path, start_new_session=True,
        )
    assert proc.pid != os.getpid() and os.getpgid(proc.pid) == proc.pid  # its own session
    deadline = time.monotonic() + 60
    while "sleeping" not in out.read_text() and time.monotonic() < deadline:
        assert proc.poll() is None, out.read_text()
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL
    with pytest.raises(subprocess.TimeoutExpired):
        warm.run([sys.executable, "-m", "tests.sleeper"], cwd=tmp_path, timeout=3)

