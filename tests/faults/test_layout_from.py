"""`meshspeed train --layout-from FILE` against what a path can be (issue 44, item 7): a link to
/dev/zero (read without a limit: 5.5 GB, then MemoryError), a file far too big, a named pipe with
no writer (blocked forever), each one line before any worker starts; a pipe that has a writer,
named or `<(cat plan.json)`, still works. Real files, pipes and processes, each bounded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from meshspeed import cli
from meshspeed.comm import launch
from meshspeed.plan import config
from tests import warm

BOUND = 120  # seconds: the hang guard of a launched command, not a speed claim
PLAN = {
    "world_size": 2,
    "machine": "cpu",
    "layouts": [{"settings": {"parallel.tp": 2, "parallel.pp": 1, "parallel.zero": 1}}],
}


def _train(tmp_path, path: str):
    cmd = [sys.executable, "-m", "meshspeed", "train", "--layout-from", path, "--dry-run"]
    return warm.run(cmd, cwd=tmp_path, timeout=BOUND)


def _one_line(done, text: str) -> None:
    err = done.stderr.strip()
    assert done.returncode == 2 and "\n" not in err, (done.returncode, err[-2000:])
    assert err.startswith("meshspeed train: --layout-from ") and text in err, err


def test_a_link_to_dev_zero_is_refused_unread(tmp_path):
    os.symlink("/dev/zero", tmp_path / "plan.json")
    done = _train(tmp_path, "plan.json")
    _one_line(done, "plan.json is not a regular file or a pipe (a device or socket); give the file")


def test_a_file_past_the_cap_is_refused_unread(tmp_path):
    with open(tmp_path / "plan.json", "wb") as f:  # sparse: no disk used
        f.truncate(config.MAX_FILE_BYTES * 16)
    done = _train(tmp_path, "plan.json")
    _one_line(done, f"plan.json holds {config.MAX_FILE_BYTES * 16:,} bytes, more than such a file has")


def test_a_named_pipe_without_a_writer_is_refused_after_a_wait(tmp_path):
    os.mkfifo(tmp_path / "plan.json")
    done = _train(tmp_path, "plan.json")
    _one_line(done, f"is a pipe nothing was written to in {config.FIFO_WAIT_S:g} s (no writer?)")


def test_a_named_pipe_with_a_writer_is_read(tmp_path):
    """The writer opens the pipe a second after the command started waiting on it."""
    fifo = tmp_path / "plan.json"
    os.mkfifo(fifo)
    code = f"import time; time.sleep(1); open({str(fifo)!r}, 'w').write({json.dumps(json.dumps(PLAN))})"
    writer = subprocess.Popen([sys.executable, "-c", code])
    try:
        done = _train(tmp_path, "plan.json")
    finally:
        writer.kill()
        writer.wait()
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ranks" in done.stdout and "tp 2" in done.stdout, done.stdout


def test_process_substitution_still_works(tmp_path, monkeypatch, capsys):
    """`--layout-from <(cat plan.json)`: an anonymous pipe, /dev/fd/N, whose writer sends late."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("a worker was started"))
    r, w = os.pipe()

    def write():
        time.sleep(0.5)
        os.write(w, json.dumps(PLAN).encode())
        os.close(w)

    t = threading.Thread(target=write)
    t.start()
    try:
        assert cli.main(["train", "--layout-from", f"/dev/fd/{r}", "--dry-run", "--json"]) == 0
    finally:
        t.join()
        os.close(r)
    plan = json.loads(capsys.readouterr().out)
    assert plan["world_size"] == 2 and plan["dims"]["tp"] == 2, plan
