"""`meshspeed data prepare` on a machine with a GPU (issue 25): tokenizing is CPU work, so the
command leaves the GPU untouched (no CUDA context) and writes the same tokens as without one. It
runs in a fresh interpreter, the only place where "CUDA was never initialised" can be read; the
cpu case hides the GPUs (CUDA_VISIBLE_DEVICES=""), so it is the same check without one."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tests import warm

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; the cpu case runs here")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = """
import sys, torch
from meshspeed.cli import main
assert main(["data", "prepare", "--input", sys.argv[1], "--out", sys.argv[2], "--workers", "2"]) == 0
print("cuda available", torch.cuda.is_available(), "initialized", torch.cuda.is_initialized())
"""


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_prepare_leaves_the_gpu_alone(tmp_path, device):
    src = tmp_path / "texts"
    src.mkdir()
    texts = ["def f():\n    return 1\n", "héllo wörld\n" * 20, "x = [i for i in range(9)]\n"]
    for i, t in enumerate(texts):
        (src / f"{i}.txt").write_text(t)
    out = tmp_path / "tokens.bin"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-c", SCRIPT, str(src), str(out)]
    # the CUDA case starts cold: what a fresh interpreter initialises is the claim there
    res = warm.run(cmd, capture_output=True, text=True, env=env, timeout=300, cold=device == "cuda")
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"cuda available {device == 'cuda'} initialized False" in res.stdout
    # bytes tokenizer: a token is a byte (read with torch: numpy is no dependency of meshspeed)
    tokens = torch.frombuffer(bytearray(out.read_bytes()), dtype=torch.uint16).tolist()
    # every file byte for byte, each ended by the bytes tokenizer's end-of-text (0); the order is
    # the command's own (its validation documents last), checked by tests/data/test_prepare.py
    docs = bytes(tokens).split(b"\0")
    assert docs[-1] == b"" and sorted(docs[:-1]) == sorted(t.encode() for t in texts)
