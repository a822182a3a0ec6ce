"""A dry run and `meshspeed plan` plan; they read no tokens (issue 44, item 4). The README's
64-GPU dry run and the planner's llama3-8b example name `data/tokens.bin`, which a fresh clone
does not have: each prints a note and plans; a real run still refuses the missing file in one
line, before any worker starts."""

from __future__ import annotations

import os

import pytest

from meshspeed import cli
from meshspeed.comm import launch

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
MISSING = ["--data.path", "data/tokens.bin", "--data.format", "uint32"]
NOTE = "data.path='data/tokens.bin' not found here; planned without it (training needs it)"


@pytest.fixture
def fresh_clone(tmp_path, monkeypatch):
    """A directory without data/, and no worker ever started."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("a worker was started"))


def test_the_readme_dry_run_needs_no_data_file(fresh_clone, capsys):
    config = os.path.join(CONFIGS, "llama3-8b.toml")
    assert cli.main(["train", "--config", config, "--nproc", "64", "--parallel.pp", "4", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "ranks 0-15" in out and f"warning      {NOTE}" in out, out


def test_plan_needs_no_data_file(fresh_clone, capsys):
    argv = ["plan", "--nproc", "4", "--device", "cpu", "--train.global_batch_size", "8", *MISSING]
    assert cli.main(argv + ["--parallel.tp", "2", "--parallel.pp", "1", "--parallel.cp", "1"]) == 0
    got = capsys.readouterr()
    assert "layouts fit on 4" in got.out, got
    assert got.err.strip() == f"meshspeed plan: note: {NOTE}", got.err


def test_a_real_run_still_refuses_the_missing_file_in_one_line(fresh_clone, capsys):
    assert cli.main(["train", "--nproc", "2", *MISSING]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("meshspeed train: data.path='data/tokens.bin' does not exist") and "\n" not in err
