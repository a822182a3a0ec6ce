"""Exports never lose what a user owns (issue 31, item 1): `convert --to-hf` and the trainer's
export write into a temporary sibling and move it into place when complete; a target holding
files meshspeed did not write is refused (or, with --overwrite, written beside them: only the
files meshspeed's own manifest lists are ever replaced or removed); an interrupted export leaves
the previous one whole, and the next one removes the leftover with a line saying so.

Each case runs the real command line (several per interpreter through tests.cli_batch, the
interruption in its own process killed by a real signal); every wait is bounded.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time

import pytest

from meshspeed import comm
from meshspeed.comm.outputs import OUTPUT_MANIFEST, read_output_manifest
from meshspeed.interop.hf_export import export_hf
from meshspeed.interop.hf_import import convert_from_hf
from meshspeed.models import get_preset, recipe_for
from meshspeed.parallel.materialize import build_parallel_model
from tests.cli_batch import ROOT, run_many
from tests.faults.procs import env


def _digests(d) -> dict[str, str]:
    return {
        n: hashlib.sha256(open(os.path.join(d, n), "rb").read()).hexdigest()
        for n in sorted(os.listdir(d))
        if os.path.isfile(os.path.join(d, n))
    }


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A user's Hugging Face model directory (no meshspeed manifest: not meshspeed's files) and
    the meshspeed checkpoint converted from it."""
    root = tmp_path_factory.mktemp("export")
    config = get_preset("tiny", n_layers=2)
    mesh = comm.ParallelDims().build(comm.init())
    model = build_parallel_model(recipe_for(config), mesh)
    src, run = str(root / "hf"), str(root / "run")
    export_hf(model, mesh, src, config, max_shard_bytes=40_000)  # several shards and an index
    os.remove(os.path.join(src, OUTPUT_MANIFEST))
    convert_from_hf(src, run)
    return src, run


def test_to_hf_never_deletes_or_replaces_files_it_did_not_write(made, tmp_path):
    src, run = made
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    (user / "model.safetensors").write_bytes(b"my own weights")
    before_src, before_user = _digests(src), _digests(user)
    into_user = ["convert", "--checkpoint", run, "--to-hf", str(user)]
    res = run_many(
        [
            ["convert", "--checkpoint", run, "--to-hf", src],  # over the source model itself
            ["convert", "--checkpoint", run, "--to-hf", src, "--overwrite"],
            into_user,
            into_user + ["--overwrite"],  # a user's model.safetensors is never replaced
        ],
        tmp_path,
    )
    for r in res:
        assert r.returncode == 2, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "meshspeed did not write" in lines[0], r.stderr
    assert "holds config.json" in res[0].stderr and "holds config.json" in res[1].stderr
    assert "--overwrite" in res[2].stderr and "holds model.safetensors" in res[3].stderr
    assert _digests(src) == before_src and _digests(user) == before_user
    assert sorted(os.listdir(tmp_path)) == ["user"]  # no leftovers beside the targets


def test_overwrite_writes_beside_user_files_and_replaces_only_its_own(made, tmp_path):
    src, run = made
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_text("my notes about this model")
    base = ["convert", "--checkpoint", run, "--to-hf", str(out), "--overwrite"]
    first, second, third = run_many(
        [base + ["--max-shard-mb", "0.04"], base, ["convert", "--checkpoint", run, "--to-hf", str(out)]],
        tmp_path,
    )
    assert first.returncode == 0, first.stderr
    assert second.returncode == 0, second.stderr  # one shard now: the earlier shards must go
    names = sorted(os.listdir(out))
    assert names == [OUTPUT_MANIFEST, "README.md", "config.json", "model.safetensors"], names
    assert (out / "README.md").read_text() == "my notes about this model"
    listed = read_output_manifest(str(out))
    assert sorted(listed) == ["config.json", "model.safetensors"]
    assert all(os.path.getsize(out / n) == v["size"] for n, v in listed.items())
    assert third.returncode == 2 and "holds README.md" in third.stderr  # without --overwrite: refused
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_a_directory_of_its_own_files_is_replaced_whole(made, tmp_path):
    src, run = made
    out = tmp_path / "out"
    a, b = run_many(
        [
            ["convert", "--checkpoint", run, "--to-hf", str(out), "--max-shard-mb", "0.04"],
            ["convert", "--checkpoint", run, "--to-hf", str(out)],
        ],
        tmp_path,
    )
    assert a.returncode == 0 and b.returncode == 0, (a.stderr, b.stderr)
    assert sorted(os.listdir(out)) == [OUTPUT_MANIFEST, "config.json", "model.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["out"]  # the old directory did not stay beside it


def test_from_hf_refuses_to_replace_a_checkpoint_without_overwrite(made, tmp_path):
    src, _ = made
    run = str(tmp_path / "run")
    ok, again, forced = run_many(
        [
            ["convert", "--from-hf", src, "--out", run],
            ["convert", "--from-hf", src, "--out", run],
            ["convert", "--from-hf", src, "--out", run, "--overwrite"],
        ],
        tmp_path,
    )
    assert ok.returncode == 0, ok.stderr
    assert again.returncode == 2 and "already holds the checkpoint step-000000" in again.stderr
    assert "--overwrite" in again.stderr and len(again.stderr.strip().splitlines()) == 1
    assert forced.returncode == 0, forced.stderr
    assert sorted(os.listdir(run)) == [".meshspeed.lock", "step-000000"]


def _entries(*dirs) -> set[str]:
    return {os.path.join(str(d), n) for d in dirs if os.path.isdir(d) for n in os.listdir(d)}


def test_interrupted_export_leaves_the_previous_one_whole(made, tmp_path):
    """SIGTERM the export the moment its first write appears: the previous export must be there
    whole (not a mix), and the next export removes the leftover, saying so."""
    src, run = made
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "meshspeed", "convert", "--checkpoint", run, "--to-hf", str(out)]
    (first,) = run_many([cmd[3:] + ["--max-shard-mb", "0.04"]], tmp_path)
    assert first.returncode == 0, first.stderr
    before, seen = _digests(out), _entries(tmp_path, out)
    proc = subprocess.Popen(
        cmd + ["--max-shard-mb", "0.01"], env={**env(), "PYTHONPATH": ROOT}, cwd=tmp_path,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 240
    try:
        while _entries(tmp_path, out) == seen and proc.poll() is None:
            assert time.monotonic() < deadline, "the export never started writing"
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    after = _digests(out)
    assert after == before, "an interrupted export changed the previous one"
    (again,) = run_many([cmd[3:]], tmp_path)
    assert again.returncode == 0, again.stderr
    if proc.returncode == -signal.SIGTERM:  # it was caught mid-write: a leftover to clean
        assert "left by an interrupted write" in again.stderr, again.stderr
    assert sorted(os.listdir(tmp_path)) == ["out"]  # nothing left beside it
    assert sorted(read_output_manifest(str(out))) == ["config.json", "model.safetensors"]
