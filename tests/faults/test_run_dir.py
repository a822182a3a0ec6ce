"""One owner per run directory, and starting over deletes only what meshspeed wrote (issue 31,
items 2, 3 and 5).

- A second `meshspeed train` on a run.dir in use stops in one line naming the first (pid and
  host); the first trains on untouched; the lock goes with its holder, even by SIGKILL.
- `run.overwrite` deletes what meshspeed's manifests list: never the Hugging Face weights of a
  `model.init_from` directory that is also the run directory, nor a file inside a checkpoint
  that the checkpoint's manifest does not list.
- A resume on other data than the checkpoint was trained on is refused unless asked for.
Real processes and signals where a process is the point; every wait bounded.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket

import pytest

from meshspeed import comm
from meshspeed.checkpoint.lock import RunDirBusy, RunDirLock
from meshspeed.checkpoint.run_dir import RUN_MANIFEST, check_resume_data
from meshspeed.comm.outputs import OUTPUT_MANIFEST
from meshspeed.interop.hf_export import export_hf
from meshspeed.interop.hf_import import convert_from_hf
from meshspeed.models import get_preset, recipe_for
from meshspeed.parallel.materialize import build_parallel_model
from meshspeed.plan import config
from meshspeed.train.job import prepare_run_dir
from tests.cli_batch import run_many
from tests.faults.procs import COMM_TIMEOUT, FAST

# Start-up on a loaded 2-core machine (each worker imports torch) can take minutes: a bound
# on a hang, not a speed claim.
BOUND = 600

LONG = FAST + ["--train.steps", "2000", "--run.timeout", str(COMM_TIMEOUT), "--nproc", "2"]
LONG += ["--parallel.tp", "2"]


def test_second_run_on_a_busy_run_dir_is_one_line_naming_the_first(start, tmp_path):
    run = tmp_path / "run"
    first = start(LONG + ["--run.dir", str(run)])
    workers = first.workers(2, timeout=BOUND)
    first.wait_rows(run, 2, timeout=BOUND)
    again = ["train", *LONG, "--run.dir", str(run), "--checkpoint.resume", "auto"]
    (second,) = run_many([again], tmp_path, BOUND)
    assert second.returncode == 2, second.stderr[-2000:]
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1, second.stderr
    owner = f"pid {first.proc.pid} on host {socket.gethostname()}"
    assert f"is in use by another meshspeed train ({owner}" in lines[0], lines[0]
    rows = len((run / "metrics.jsonl").read_text().splitlines())
    first.wait_rows(run, rows + 2, timeout=BOUND)  # the first run goes on, alone
    os.kill(first.proc.pid, signal.SIGKILL)  # the holder dies without a word: the lock goes with it
    assert first.finish(60) == -signal.SIGKILL
    assert not first.gone(workers)
    with RunDirLock(str(run)):
        pass


def test_lock_is_exclusive_and_names_its_holder(tmp_path):
    with RunDirLock(str(tmp_path), what="meshspeed convert"):
        holder = rf"in use by another meshspeed convert \(pid {os.getpid()} on host "
        with pytest.raises(RunDirBusy, match=holder):
            RunDirLock(str(tmp_path)).acquire()
    RunDirLock(str(tmp_path)).acquire().release()  # released


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A user's Hugging Face model directory (config.json + safetensors, not meshspeed's)."""
    root = tmp_path_factory.mktemp("hf")
    cfg = get_preset("tiny", n_layers=1)
    mesh = comm.ParallelDims().build(comm.init())
    export_hf(build_parallel_model(recipe_for(cfg), mesh), mesh, str(root / "hf"), cfg)
    os.remove(root / "hf" / OUTPUT_MANIFEST)
    return root / "hf"


def _cfg(run, *extra):
    return config.load(None, [("run.dir", str(run)), *extra])


def test_overwrite_keeps_the_init_from_weights_in_the_run_dir(hf_model, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(hf_model, run)
    mine = {n: (run / n).read_bytes() for n in os.listdir(run)}
    prepare_run_dir(_cfg(run, ("model.init_from", str(run))), lead=True)  # claims the run's names
    convert_from_hf(str(run), str(run))  # what the run then wrote: a checkpoint, metrics
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    (run / "step-000000" / "my-notes.txt").write_text("written by hand into a checkpoint")
    prepare_run_dir(_cfg(run, ("model.init_from", str(run)), ("run.overwrite", "true")), lead=True)
    left = sorted(n for n in os.listdir(run) if not n.startswith(".meshspeed"))
    assert left == sorted(mine) + ["step-000000"], left
    assert all((run / n).read_bytes() == b for n, b in mine.items())
    assert os.listdir(run / "step-000000") == ["my-notes.txt"]  # the checkpoint's own files went


def test_a_run_that_would_replace_a_user_file_is_refused_before_it_starts(hf_model, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(hf_model, run)
    (run / "model.safetensors").write_bytes(b"a user's weights")
    for extra in ((), (("run.overwrite", "true"),)):
        with pytest.raises(comm.ConfigError, match="holds model.safetensors, which meshspeed did not write"):
            prepare_run_dir(_cfg(run, ("checkpoint.export_safetensors", "true"), *extra), lead=True)
    assert (run / "model.safetensors").read_bytes() == b"a user's weights"
    assert not (run / RUN_MANIFEST).exists()


def test_resume_on_other_data_is_refused_unless_asked(tmp_path):
    data = {"path": "", "format": "text", "tokenizer": "bytes", "max_mb": 8.0}
    state = {"extra": {"config": {"data": data}, "model_config": {"vocab_size": 256}}}
    check_resume_data("ck", state, {"data": data}, 256)
    changes = (("path", "b.bin"), ("tokenizer", "/models/llama"), ("format", "uint16"), ("max_mb", 1.0))
    for key, value in changes:
        with pytest.raises(comm.ConfigError, match=rf"data\.{key}=.* but this run has data\.{key}=") as e:
            check_resume_data("ck", state, {"data": {**data, key: value}}, 256)
        assert "--checkpoint.allow_data_change true" in str(e.value) and "\n" not in str(e.value)
    token_file = {**data, "path": "t.bin"}  # the corpus cap applies to the built-in corpus only
    saved = {"extra": {"config": {"data": token_file}}}
    check_resume_data("ck", saved, {"data": {**token_file, "max_mb": 1}}, 256)
    with pytest.raises(comm.ConfigError, match="256-token vocabulary but this run's model has 512"):
        check_resume_data("ck", state, {"data": data}, 512)
