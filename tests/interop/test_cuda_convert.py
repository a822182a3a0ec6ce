"""`meshspeed convert` on a machine with a GPU (issue 25): a file conversion reads and writes
without touching the GPU (no CUDA context, no device memory taken from a job beside it), and the
round trip Hugging Face -> meshspeed -> Hugging Face returns every tensor bit for bit. It runs in
a fresh interpreter, the only place where "CUDA was never initialised" can be read; the cpu case
hides the GPUs (CUDA_VISIBLE_DEVICES=""), so it is the same check on a machine without one."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.interop.test_hf import _files, make_hf

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; the cpu case runs here")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = """
import sys, torch
from meshspeed.cli import main
hf, ckpt, out = sys.argv[1:4]
assert main(["convert", "--from-hf", hf, "--out", ckpt]) == 0
assert main(["convert", "--checkpoint", ckpt, "--to-hf", out]) == 0
print("cuda available", torch.cuda.is_available(), "initialized", torch.cuda.is_initialized())
"""


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_convert_round_trip_leaves_the_gpu_alone(tmp_path, device):
    hf, ckpt, out = (str(tmp_path / n) for n in ("hf", "ckpt", "out"))
    make_hf("llama", hf)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT, hf, ckpt, out], capture_output=True, text=True, env=env, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"cuda available {device == 'cuda'} initialized False" in res.stdout
    want, got = _files(hf), _files(out)
    assert sorted(want) == sorted(got)
    for name, t in want.items():
        assert torch.equal(t, got[name]), name
