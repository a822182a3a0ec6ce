"""benchmarks/gpu_report.py without CUDA: one line saying so, exit status 0, no report files."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the no-CUDA path; on CUDA run the report itself"
)
def test_gpu_report_without_cuda_says_so_and_exits_0(tmp_path):
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_report.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0]
    assert not (tmp_path / "gpu_report.json").exists()
