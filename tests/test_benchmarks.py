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
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "MESHSPEED_ALGO"):
        env.pop(k, None)
    env["MESHSPEED_LINK_PARAMS"] = "none"  # built-in cost model: the same algorithm choices everywhere
    return env


@pytest.mark.slow
def test_train_step_benchmark_runs(tmp_path):
    rows_file = tmp_path / "rows.json"
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "train_step.py"), "--nproc", "2", "--steps", "2",
         "--rounds", "1", "--warmup", "1", "--batch", "4", "--seq-len", "32", "--json", str(rows_file)],
        capture_output=True, text=True, timeout=300, env=_env(), cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "peer/meshspeed" in out.stdout and "counted bytes per rank" in out.stdout, out.stdout
    assert "LOSS MISMATCH" not in out.stdout, out.stdout
    data = json.load(open(rows_file))
    assert not data["loss_mismatch"]
    configs = {r["config"] for r in data["rows"] if "meshspeed_ms" in r}
    assert {"dp=2 zero=0", "dp=2 zero=2", "dp=1 tp=2", "dp=1 tp=2 sp"} <= configs
