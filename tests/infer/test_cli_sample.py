"""`meshspeed sample`: each bad flag is one line before any worker starts; the rank-0 side writes
one PNG per image and a grid with a row per class and prints images/s; `--help` imports no torch.

The model is StandIn (test_diffusion.py) until models/dit.py lands; the loading of a 'dit' run
directory is infer/sample_run.load_model, the path `meshspeed generate` takes for a Llama run."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
from PIL import Image

from meshspeed import comm
from meshspeed.cli import main
from meshspeed.comm.errors import ConfigError
from meshspeed.infer.sample_run import parse_classes, sample_and_report
from meshspeed.models import get_preset
from tests.infer.test_diffusion import N_CLASSES, StandIn


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    """A run directory whose checkpoint records a Llama config: sample must refuse it."""
    from meshspeed.checkpoint.dcp import save_checkpoint

    d = str(tmp_path_factory.mktemp("run"))
    mesh = comm.ParallelDims().build(comm.init())
    extra = {"model_config": dataclasses.asdict(get_preset("tiny"))}
    save_checkpoint(d, 1, StandIn(), None, mesh, extra=extra)
    return d


@pytest.mark.parametrize(
    "argv,needle",
    [
        ([], "give exactly one of --run DIR (a training run) or --checkpoint PATH"),
        (["--run", "a", "--checkpoint", "b"], "give exactly one of --run DIR"),
        (["--run", "nowhere"], "--run='nowhere' does not exist; give a run directory or a checkpoint"),
        (["--run", "x", "--steps", "0"], "--steps=0 must be an integer ≥ 1"),
        (["--run", "x", "--sampler", "rk4"], "--sampler='rk4' is not valid; choose one of euler, heun"),
        (["--run", "x", "--guidance", "nan"], "--guidance=nan must be a finite number"),
        (["--run", "x", "--n", "0"], "--n=0 must be ≥ 1"),
        (["--run", "x", "--nproc", "0"], "--nproc=0 must be ≥ 1"),
    ],
)
def test_bad_flags_are_one_line(argv, needle, capsys):
    assert main(["sample", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"meshspeed sample: {needle}" or (needle in err and len(err.splitlines()) == 1), err


def test_out_must_not_be_a_file(tmp_path, capsys):
    f = tmp_path / "f"
    f.write_text("")
    assert main(["sample", "--run", str(tmp_path), "--out", str(f)]) == 2
    assert capsys.readouterr().err.strip().endswith("is a file; name a directory for the PNGs")


def test_a_text_model_is_refused(llama_run, capsys):
    assert main(["sample", "--run", llama_run]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds a 'llama' model; meshspeed sample draws images from 'dit' models" in err
    assert len(err.splitlines()) == 1


def test_parse_classes():
    assert parse_classes("3, 1,1", 10) == [3, 1, 1]
    assert parse_classes(None, 4) == [0, 1, 2, 3]
    for bad in ("10", "a", "1,,2", "-1"):
        with pytest.raises(
            ConfigError, match=r"^--classes=.* is not a class id; give comma-separated ids in 0..9"
        ):
            parse_classes(bad, 10)
    with pytest.raises(ConfigError, match="no class labels"):
        parse_classes("0", 0)


def test_rank0_writes_pngs_and_grid(tmp_path, capsys):
    out = str(tmp_path / "s")
    job = {
        "labels": [c for c in (2, 5, 7) for _ in range(4)], "per_class": 4, "shape": [1, 8, 8],
        "steps": 2, "sampler": "euler", "guidance": 2.0, "seed": 0, "null_class": N_CLASSES,
        "out": out, "nproc": 1,
    }  # fmt: skip
    got = sample_and_report(StandIn().eval(), job, None, 0)
    files = sorted(os.listdir(out))
    assert files[0] == "grid.png" and len(files) == 13 and files[1] == "sample-0000-c2.png"
    assert files[-1] == "sample-0011-c7.png"
    one = Image.open(os.path.join(out, files[1]))
    assert one.size == (8, 8) and one.mode == "L"
    # 4 columns (images per class) × 3 rows (classes) of 64-pixel tiles (8 × 8 scaled 8×), 1-pixel gaps
    assert Image.open(os.path.join(out, "grid.png")).size == (4 * 65 + 1, 3 * 65 + 1)
    assert got["images"].shape == (12, 1, 8, 8)
    printed = capsys.readouterr().out
    assert "wrote 12 PNGs and grid.png" in printed and "images/s" in printed


def test_help_imports_no_torch():
    # the sample command's own parser alone (another command's module may import torch itself)
    code = (
        "import argparse, sys\n"
        "from meshspeed.commands import sample\n"
        "p = argparse.ArgumentParser(); sample.register(p.add_subparsers())\n"
        "try: p.parse_args(['sample', '--help'])\n"
        "except SystemExit: pass\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert out.strip().endswith("False"), out
