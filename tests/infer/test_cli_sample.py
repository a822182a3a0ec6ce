"""`meshspeed sample`: from a dit run directory (a checkpoint save_checkpoint wrote, recording
its model config as the trainer's do) --nproc 1, 2 and 3 write byte-identical PNGs; each bad
flag is one line before any worker starts; rank 0 writes one PNG per image and a grid with a
row per class and prints images/s; `--help` imports no torch."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from PIL import Image

from meshspeed import comm
from meshspeed.cli import main
from meshspeed.comm.errors import ConfigError
from meshspeed.infer.diffusion import sample
from meshspeed.infer.sample_run import parse_classes, sample_and_report
from meshspeed.models import get_preset
from tests.infer.test_diffusion import N_CLASSES, png_bytes, tiny_dit


def _run_dir(d: str, model, config) -> str:
    from meshspeed.checkpoint.dcp import save_checkpoint

    mesh = comm.ParallelDims().build(comm.init())
    save_checkpoint(d, 1, model, None, mesh, extra={"model_config": dataclasses.asdict(config)})
    return d


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    """A run directory whose checkpoint records a Llama config: sample must refuse it."""
    return _run_dir(str(tmp_path_factory.mktemp("run")), torch.nn.Linear(2, 2), get_preset("tiny"))


@pytest.fixture(scope="module")
def dit_run(tmp_path_factory):
    model = tiny_dit(seed=2)
    return _run_dir(str(tmp_path_factory.mktemp("dit")), model, model.config)


ARGS = [
    "--classes",
    "1,4,7",
    "--n",
    "2",
    "--steps",
    "2",
    "--sampler",
    "heun",
    "--guidance",
    "2",
    "--seed",
    "3",
]


def _pngs(d) -> dict[str, bytes]:
    return {f: open(os.path.join(d, f), "rb").read() for f in sorted(os.listdir(d))}


@pytest.fixture(scope="module")
def solo_pngs(dit_run, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("solo"))
    assert main(["sample", "--run", dit_run, "--out", out, *ARGS]) == 0
    return _pngs(out)


def test_run_dir_samples(solo_pngs):
    assert len(solo_pngs) == 7 and "grid.png" in solo_pngs and "sample-0005-c7.png" in solo_pngs
    # the checkpoint's weights were loaded: the PNGs are those of the saved model sampled here
    # (a fresh dit's adaLN-Zero predicts v = 0 and would leave the noise)
    labels = torch.tensor([1, 1, 4, 4, 7, 7])
    want = sample(tiny_dit(seed=2), labels, (1, 8, 8), steps=2, sampler="heun", guidance=2.0, seed=3,
                  null_class=N_CLASSES)  # fmt: skip
    for i, (png, c) in enumerate(zip(png_bytes(want), labels.tolist(), strict=True)):
        assert solo_pngs[f"sample-{i:04d}-c{c}.png"] == png, i


@pytest.mark.parametrize("nproc", [2, 3])
def test_nproc_writes_the_same_pngs(dit_run, solo_pngs, tmp_path, nproc):
    assert main(["sample", "--run", dit_run, "--out", str(tmp_path), "--nproc", str(nproc), *ARGS]) == 0
    assert _pngs(tmp_path) == solo_pngs


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--classes", "3,10"], "--classes='3,10': '10' is not a class id; give comma-separated ids in 0..9"),
        (["--prompts", "p.txt"], "--prompts: text-conditioned sampling is not available yet"),
    ],
)
def test_bad_flags_for_the_model_are_one_line(dit_run, argv, needle, capsys):
    assert main(["sample", "--run", dit_run, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err


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
    got = sample_and_report(tiny_dit(), job, None, 0)
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


def test_score_prints_the_digit_figure(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the classifier trained here
    job = {
        "labels": list(range(10)) * 2, "per_class": 10, "shape": [1, 8, 8], "steps": 1,
        "sampler": "euler", "guidance": 1.0, "seed": 0, "null_class": N_CLASSES,
        "out": str(tmp_path / "s"), "score": True,
    }  # fmt: skip
    got = sample_and_report(tiny_dit(), job, None, 0)
    assert got["score"]["n"] == 20 and 0 <= got["score"]["accuracy"] <= 1 and got["score"]["fid"] > 0
    assert "the digit classifier recognises" in capsys.readouterr().out


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
