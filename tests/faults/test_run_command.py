"""`meshspeed run script.py`: a user's own script on meshspeed's launcher (issue 29), as real
processes. Each script is a few lines written into tmp_path; each job is bounded by a
subprocess timeout, so a hang fails its test (the bounds are not speed claims: a loaded 2-core
machine needs a minute to import torch in three processes).
"""

from __future__ import annotations

import signal
import sys
import textwrap

import pytest

from meshspeed import cli
from meshspeed.comm import launch
from tests.faults.procs import alive

BOUND = 300  # seconds for a whole job: start, run, stop
GROUP = ["--nproc", "2"]
STOPPED = " (the other worker was stopped)"

# torch.distributed as a torchrun user writes it; `mode` on rank 1 decides how it fails.
PLAIN = """
import os, sys, time
import torch
import torch.distributed as dist

assert __name__ == "__main__"
rank = int(os.environ["RANK"])
with open(f"pid-{rank}", "w") as f:  # for the test: which processes must be gone at the end
    f.write(str(os.getpid()))
dist.init_process_group("gloo")
mode = sys.argv[1]
if mode == "raise" and rank == 1:
    raise ValueError("bad batch 7 on this rank")
if mode == "kill" and rank == 1:
    os.kill(os.getpid(), 9)
if mode in ("raise", "kill", "sleep"):
    dist.barrier()  # rank 0 waits for a rank 1 that never comes: the launcher must stop it
    time.sleep(600)
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
if rank == 0:
    env = {k: os.environ[k] for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT")}
    print(f"sum={t.item():g} argv={sys.argv[1:]} env={env}", flush=True)
raise SystemExit(0)  # success, not a failure of the rank
"""

# meshspeed.comm.init(); the first attempt fails on rank 1, after the group has formed.
MESHSPEED = """
import os
import torch
from meshspeed import comm

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
ctx = comm.init()
x = torch.tensor([float(ctx.rank + 1)])
comm.all_reduce(x, ctx.world)
if attempt == 0 and ctx.rank == 1:
    raise RuntimeError("first attempt fails")
if ctx.rank == 0:
    print(f"attempt {attempt}: sum={x.item():g} of {ctx.world_size}", flush=True)
ctx.close()
"""


def _script(tmp_path, text: str, name: str = "script.py") -> str:
    (tmp_path / name).write_text(textwrap.dedent(text))
    return name  # the job runs in tmp_path


def _pids(tmp_path, n: int = 2) -> list[int]:
    return [int((tmp_path / f"pid-{r}").read_text()) for r in range(n)]


def _both_pids(tmp_path):
    return lambda: all((tmp_path / f"pid-{r}").exists() for r in range(2))


def test_plain_torch_distributed_script(start, tmp_path):
    job = start([*GROUP, _script(tmp_path, PLAIN), "sum", "--lr", "3"], command="run")
    assert job.finish(BOUND) == 0, job.stderr[-3000:]
    want = "sum=3 argv=['sum', '--lr', '3'] env={'WORLD_SIZE': '2', 'LOCAL_WORLD_SIZE': '2', "
    assert want + "'TORCHELASTIC_RESTART_COUNT': '0'}" in job.stdout, job.stdout + job.stderr[-3000:]


@pytest.mark.parametrize(
    "mode, line",
    [
        ("raise", "meshspeed: rank 1 failed: ValueError: bad batch 7 on this rank" + STOPPED),
        ("kill", "meshspeed: rank 1 was killed by SIGKILL (exit -9): out of memory?" + STOPPED),
    ],
    ids=["raise", "kill"],
)
def test_failed_rank_is_named_and_no_worker_is_left(start, tmp_path, mode, line):
    job = start([*GROUP, _script(tmp_path, PLAIN), mode], command="run")
    assert job.finish(BOUND) == 1, job.stderr[-3000:]
    assert job.last_line() == line, job.stderr[-3000:]
    if mode == "raise":  # a bug's traceback comes with it, with the script's own line
        assert "Traceback" in job.stderr and 'raise ValueError("bad batch 7' in job.stderr
    assert not [p for p in _pids(tmp_path) if alive(p)]


def test_sigterm_to_the_launcher_leaves_no_worker(start, tmp_path):
    job = start([*GROUP, _script(tmp_path, PLAIN), "sleep"], command="run")
    job.wait_for("both pid files", _both_pids(tmp_path), BOUND)
    job.proc.send_signal(signal.SIGTERM)
    assert job.finish(BOUND) == 128 + signal.SIGTERM, job.stderr[-3000:]
    assert job.last_line() == "meshspeed: stopped by SIGTERM; all 2 workers stopped", job.stderr[-3000:]
    assert not job.gone(_pids(tmp_path))


def test_meshspeed_init_script_restarts_after_a_failure(start, tmp_path):
    """Also the `meshspeed.comm.init()` path: the second attempt is a clean run of it."""
    job = start([*GROUP, "--max-restarts", "1", _script(tmp_path, MESHSPEED)], command="run")
    assert job.finish(BOUND) == 0, job.stderr[-3000:]
    err = job.stderr
    assert "meshspeed: rank 1 failed: RuntimeError: first attempt fails" in err, err[-3000:]
    assert "meshspeed run: restart 1 of 1: starting all 2 workers again (TORCHELASTIC_RESTART_COUNT=1)" in err
    assert "attempt 1: sum=3 of 2" in job.stdout, job.stdout + err[-3000:]


@pytest.mark.parametrize(
    "args, line",
    [
        ([], "no script given; name a Python file: meshspeed run --nproc 2 train.py [args...]"),
        (["missing.py"], "script=missing.py does not exist"),
        (["notes.txt"], "script=notes.txt is not a Python file (.py)"),
        (["adir"], "script=adir is not a file; give the .py file to run, e.g. adir/train.py"),
        (["--nproc", "0", "ok.py"], "--nproc=0 must be a whole number ≥ 1; e.g. --nproc 2"),
        (["--nproc", "two", "ok.py"], "--nproc=two must be a whole number ≥ 1; e.g. --nproc 2"),
        (["--max-restarts", "-1", "ok.py"], "--max-restarts=-1 must be a whole number ≥ 0; e.g. --max"),
        (["--start-method", "fork", "ok.py"], "--start-method=fork is not known; valid: auto, spawn"),
    ],
)
def test_bad_arguments_are_one_line_before_any_worker(tmp_path, monkeypatch, capsys, args, line):
    (tmp_path / "ok.py").write_text("")
    (tmp_path / "notes.txt").write_text("")
    (tmp_path / "adir").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("a worker was started"))
    assert cli.main(["run", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshspeed run: " + line), err


def test_help_explains_the_command(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    out = capsys.readouterr().out
    needed_words = ("--max-restarts", "TORCHELASTIC_RESTART_COUNT", "MASTER_PORT", "killed by SIGKILL")
    for needed in (*needed_words, "--start-method", "fresh interpreters"):
        assert needed in out, needed


def test_script_exit_codes_in_a_worker(tmp_path, monkeypatch):
    """sys.exit(0) is success; any other exit is reported in one line (not 'without reporting')."""
    from meshspeed.commands.run import ScriptExit, script_worker

    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the worker sets both, as python does
    monkeypatch.setattr(sys, "path", list(sys.path))
    path = str(tmp_path / "exits.py")
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(eval(sys.argv[1]))\n")
    script_worker(path, ["0"])
    script_worker(path, ["None"])
    for code, line in (("'no data in data/'", "no data in data/"), ("3", "the script called sys.exit(3)")):
        with pytest.raises(ScriptExit) as err:
            script_worker(path, [code])
        assert launch.headline(err.value) == line


# Which start the workers had: a module the launcher preloads only when it forks them (`auto` on
# a machine without a GPU, and the script names meshspeed.parallelize at its top level).
PRELOADED = """
import os, sys
had = "meshspeed.interop.parallelize" in sys.modules
import meshspeed
meshspeed.parallelize
print(f"rank {os.environ['RANK']} preloaded={had}", flush=True)
"""


@pytest.mark.parametrize("method, want", [("auto", True), ("spawn", False)])
def test_workers_share_the_launchers_imports_unless_spawn_is_asked(start, tmp_path, method, want):
    job = start([*GROUP, "--start-method", method, _script(tmp_path, PRELOADED)], command="run")
    assert job.finish(BOUND) == 0, job.stderr[-3000:]
    for r in range(2):
        assert f"rank {r} preloaded={want}" in job.stdout, job.stdout + job.stderr[-3000:]


def test_what_the_launcher_preloads_is_read_from_the_script_never_run(tmp_path, monkeypatch):
    from meshspeed.commands.run import preload, preloadable

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(
        "open('ran', 'w').close()\n"
        "import json, torch.nn as nn\n"
        "from transformers import LlamaConfig\n"
        "import mylib\n"
        "model = transformers.LlamaForCausalLM\n"
        "def f():\n    import numpy\n"
    )
    got = preloadable("train.py")
    assert got == {"torch": set(), "transformers": {"LlamaConfig", "LlamaForCausalLM"}}, got
    assert not (tmp_path / "ran").exists()
    (tmp_path / "broken.py").write_text("import torch\ndef (:\n")
    assert preloadable("broken.py") == {}
    preload({"meshspeed_has_no_such_module": {"x"}, "torch": {"no_such_name"}})  # left to the worker
