"""benchmarks/gpu_report.py without a GPU: it says so in one line; --dry writes the report of what a
GPU run would do; the CUDA-path test selection keeps the tests that name CUDA and only those; and
(slow) --cpu-smoke runs every step at toy sizes on the CPU, so the script is known to work
before a GPU machine is rented for it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests import warm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args, timeout=120, env=None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, *args]
    return warm.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the no-CUDA path; on CUDA run the report itself"
)
def test_gpu_report_without_cuda_says_so_and_exits_0(tmp_path):
    out = _run("-m", "benchmarks.gpu_report", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0]
    assert not (tmp_path / "gpu_report.json").exists()


def test_dry_lists_every_step_of_a_gpu_run(tmp_path):
    out = _run("-m", "benchmarks.gpu_report", "--dry", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    rep = json.loads((tmp_path / "gpu_report.json").read_text())
    names = [c["command"] for c in rep["commands"]]
    want = ["train (README default)", "train --nproc 1 bf16 on cuda", "resume on cpu", "generate on cuda"]
    want += ["generate vs transformers", "eval on cuda", "convert --to-hf again", "train --dry-run --nproc 1"]
    assert set(want) <= set(names)
    files = rep["tests"]["files"]
    assert "tests/infer/test_cuda_generate.py" in files and "tests/kernels/test_fused.py" in files
    assert "tests/kernels/test_gpu_report.py" not in files  # the report does not run itself
    not_run = "\n".join(rep["not_run"])
    assert "offload_optimizer, accumulation 8" in not_run and "sparse_linear" in not_run
    assert "## Commands on one GPU" in (tmp_path / "gpu_report.md").read_text()


def test_cuda_path_selection_keeps_the_tests_that_name_cuda(tmp_path):
    args = ["-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-p", "benchmarks.gpu_tests"]
    out = _run(*args, "tests/plan/test_device.py", env={"GPU_REPORT_SELECT": "1"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    kept = {line.split("::")[1] for line in out.stdout.splitlines() if "::" in line}
    assert "test_comm_init_puts_the_process_on_the_chosen_device[cuda]" in kept  # a CUDA parameter
    assert "test_comm_init_puts_the_process_on_the_chosen_device[cpu]" in kept  # its source names CUDA
    assert "test_cli_refuses_cuda_before_spawning" in kept
    assert "test_no_gpu_runs_on_cpu_silently_and_cpu_is_honoured_next_to_gpus" not in kept
    assert "deselected" in out.stdout


@pytest.mark.slow  # every command and a few trainer settings at toy sizes: minutes on a laptop
def test_cpu_smoke_runs_every_step(tmp_path):
    args = ["--cpu-smoke", "--budget", "100000", "--out", str(tmp_path)]  # a shared laptop: no time limit
    out = _run("-m", "benchmarks.gpu_report", *args, timeout=7200)
    assert out.returncode == 0, out.stderr[-3000:]
    rep = json.loads((tmp_path / "gpu_report.json").read_text())
    bad = [(c["command"], c["note"]) for c in rep["commands"] if c["ok"] is not True]
    assert not bad and len(rep["commands"]) == 11
    assert rep["tests"]["passed"] >= 1 and rep["tests"]["failed"] == 0
    assert [f["name"] for f in rep["features"]] == ["plain", "chunked_loss", "recompute full"]
    assert all("step_ms" in f for f in rep["features"]), rep["features"]
    notes = {c["command"]: c["note"] for c in rep["commands"]}
    assert "bit for bit" in notes["convert --to-hf again"] and "on cpu" in notes["generate on cpu"]
    assert rep["trainer"]["rc"] == 0 and [s["rc"] for s in rep["sparse"]] == [0]  # sparse_step: GPU only
