"""Benchmarks run end to end. Slow (they spawn workers and time steps), so excluded by
default: `python -m pytest -m slow`. Times are never asserted; only that the script runs,
prints its table, and that meshspeed and each peer computed the same losses."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env() -> dict:
    env = dict(os.environ)
    for k in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "MESHSPEED_ALGO",
    ):
        env.pop(k, None)
    env["MESHSPEED_LINK_PARAMS"] = "none"  # built-in cost model: the same algorithm choices everywhere
    return env


def _bench(script: str, args: list, cwd, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run benchmarks/<script> with args in a clean environment; the completed process."""
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", script), *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=cwd)


@pytest.mark.slow
def test_train_step_benchmark_runs(tmp_path):
    rows_file = tmp_path / "rows.json"
    args = ["--nproc", 2, "--steps", 2, "--rounds", 1, "--warmup", 1, "--batch", 4, "--seq-len", 32]
    out = _bench("train_step.py", args + ["--json", rows_file], tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "peer/meshspeed" in out.stdout and "counted bytes per rank" in out.stdout, out.stdout
    assert "LOSS MISMATCH" not in out.stdout, out.stdout
    data = json.load(open(rows_file))
    assert not data["loss_mismatch"]
    configs = {r["config"] for r in data["rows"] if "meshspeed_ms" in r}
    assert {"dp=2 zero=0", "dp=2 zero=2", "dp=1 tp=2", "dp=1 tp=2 sp"} <= configs


@pytest.mark.slow  # 4 ranks building a model: the born-sharded storage check runs in test_tensor.py
def test_build_memory_benchmark_runs(tmp_path):
    """benchmarks/build_memory.py end to end on a ~25 MB model (2 ranks, one job per mode): it
    prints its table and writes its figures; the old path holds the whole fp32 model on every
    rank and the born-sharded path peaks lower. Sizes chosen so the margins are MiBs while RSS
    noise after the script's warm-up build is KiBs: FFN-heavy (3 x 64 x 16384 per block)."""
    figures = tmp_path / "build_memory.json"
    args = ["--dim", 64, "--layers", 2, "--vocab", 256, "--ffn", 16384, "--tp", 2, "--json", figures]
    out = _bench("build_memory.py", args, tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "peak bytes" in out.stdout and "before / after peak growth" in out.stdout, out.stdout
    data = json.load(open(figures))
    model = data["model"]
    full = model["full_bytes"]
    assert full == 4 * model["param_count"] > 20 * 2**20
    assert model["largest"]["bytes"] == 4 * 64 * 16384
    rows = {(r["mode"], r["rank"]): r for r in data["rows"]}
    assert set(rows) == {(m, r) for m in ("before", "after") for r in (0, 1)}
    for r in rows.values():
        assert r["peak_growth"] > 0 and r["own_param_bytes"] > 0, r
        assert r["param_storage_bytes"] >= r["own_param_bytes"], r
    for rank in (0, 1):
        before, after = rows["before", rank], rows["after", rank]
        assert after["own_param_bytes"] == before["own_param_bytes"]  # the same pieces either way
        assert before["param_storage_bytes"] == before["own_param_bytes"]  # parallelize copies its pieces
        assert before["peak_growth"] >= 0.8 * full, before  # every rank held the whole model
        assert after["peak_growth"] < before["peak_growth"], (before, after)
    assert len(data["ratios"]["per_rank"]) == 2 and all(x > 0 for x in data["ratios"]["per_rank"])


@pytest.mark.slow
def test_moe_benchmark_runs():
    args = ["--ep", 2, "--dim", 32, "--hidden", 64, "--tokens", 64, "--steps", 1]
    out = _bench("moe.py", args, ROOT, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    for line in ("ep a2a serial", "shared-expert overlap (2 shared)", "torch._grouped_mm"):
        assert line in out.stdout, out.stdout


@pytest.mark.slow
def test_zero3_benchmark_runs(tmp_path):
    """benchmarks/zero3.py end to end on the tiny model (3 blocks, 2 ranks): meshspeed ZeRO-3 and
    FSDP2 compute the same losses, and each holds 1/dp of the parameters between steps and more
    (gathered blocks) at its peak."""
    rows_file = tmp_path / "rows.json"
    args = ["--model", "tiny", "--layers", "3", "--nproc", "2", "--steps", "2", "--rounds", "1"]
    args += ["--warmup", "1", "--batch", "4", "--seq-len", "32", "--json", str(rows_file)]
    out = _bench("zero3.py", args, tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "peak param bytes/rank" in out.stdout and "FSDP2/meshspeed step time" in out.stdout, out.stdout
    assert "LOSS MISMATCH" not in out.stdout, out.stdout
    rows = {r["side"]: r for r in json.load(open(rows_file))["rows"]}
    assert set(rows) == {"meshspeed", "peer"} and all(r["loss_ok"] for r in rows.values())
    ms = rows["meshspeed"]
    assert ms["exact_peak_param_bytes"] >= ms["peak_param_bytes"] > ms["param_bytes_between_steps"] > 0
    for r in rows.values():
        assert r["step_ms"] > 0 and r["peak_param_bytes"] > r["param_bytes_between_steps"] > 0, r


@pytest.mark.slow
def test_memory_benchmark_runs_every_feature():
    args = ["--dim", 64, "--layers", 2, "--seq", 32, "--steps", 1, "--no-zero3"]
    out = _bench("memory.py", args, ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "not run:" not in out.stdout, out.stdout  # every feature ran
    for row in (
        "recompute full",
        "ZeRO-3",
        "offload optimizer",
        "reuse fp32 param (bf16)",
        "swap activations",
    ):
        assert row in out.stdout, out.stdout
