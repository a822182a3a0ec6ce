"""Benchmarks run end to end. Slow (they spawn workers and time steps), so excluded by
default: `python -m pytest -m slow`. Times are never asserted; only that the script runs,
prints its table, and that meshspeed and each peer computed the same losses. The shared
harness and the peers are checked fast: a peer that computes something other than the
single-device model would make every ratio against it meaningless."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from benchmarks import harness, peers
from meshspeed import comm
from meshspeed.models import cross_entropy_loss
from tests import harness as pool
from tests import warm

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
    """Run `python -m benchmarks.<script>` with args in a clean environment, from cwd with the
    repository importable; the completed process."""
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, [env.get("PYTHONPATH")])])
    cmd = [sys.executable, "-m", f"benchmarks.{script.removesuffix('.py')}", *map(str, args)]
    return warm.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


# ------------------------------------------------------------------------------ harness and peers
def test_storage_bytes_counts_each_storage_once_and_released_ones_as_zero():
    base = torch.zeros(64)  # 256 bytes
    other = torch.zeros(8, dtype=torch.float64)  # 64 bytes
    assert harness.storage_bytes([base, base[:8], base.view(8, 8), other, None]) == 256 + 64
    gone = torch.zeros(32)
    gone.untyped_storage().resize_(0)  # as ZeRO-3 releases a gathered block
    assert harness.storage_bytes([base, gone]) == 256
    assert harness.storage_bytes([torch.empty(4, device="meta")]) == 0


def test_ratio_and_agreement():
    assert harness.ratio([1.0, 2.0, 4.0], [2.0, 2.0, 2.0]) == (1.0, 0.5, 2.0)
    assert harness.agree([1.0, 2.0], [1.0, 2.0 * (1 + 1e-6)], 1e-5)
    assert not harness.agree([1.0, 2.0], [1.0, 2.0 * (1 + 1e-4)], 1e-5)


def _tp_peer_matches_one_device(ctx, sp: bool):
    """DTensor TP (+SP) on the tp ranks computes the single-device loss and gradients."""
    torch.manual_seed(0)
    x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
    ref = harness.preset_model("tiny", 16, seed=0)
    ref_loss = cross_entropy_loss(ref(x), y)
    ref_loss.backward()
    mesh = comm.ParallelDims(tp=ctx.world_size).build(ctx)
    model = peers.dtensor_tp(harness.preset_model("tiny", 16, seed=0), mesh.device_mesh["tp"], sp)
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, -2), y.flatten())
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        torch.testing.assert_close(grad, want[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    # one AdamW step on each (the benchmark's second loss): the sharded gradients must update
    # every piece as the whole gradient updates the whole weight
    for m in (ref, model):
        peers.adamw(m).step()
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, -2), y.flatten())
    torch.testing.assert_close(loss, cross_entropy_loss(ref(x), y), rtol=1e-5, atol=1e-6)
    return []


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp-sp"])
def test_dtensor_tp_peer_matches_one_device(sp):
    assert pool.run(2, _tp_peer_matches_one_device, sp) == [[], []]


@pytest.mark.slow
def test_train_step_benchmark_runs(tmp_path):
    rows_file = tmp_path / "rows.json"
    args = ["--nproc", 2, "--steps", 2, "--rounds", 1, "--warmup", 1, "--batch", 4, "--seq-len", 32]
    out = _bench("train_step.py", args + ["--json", rows_file], tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "peer/meshspeed" in out.stdout and "counted bytes per rank" in out.stdout, out.stdout
    assert "LOSS MISMATCH" not in out.stdout, out.stdout
    # which algorithm each side's collectives ran (gloo's reduce-scatter is meshspeed's ring by default)
    assert "tp reduce_scatter: ring" in out.stdout and "torch.distributed's own" in out.stdout, out.stdout
    data = json.load(open(rows_file))
    assert not data["loss_mismatch"]
    timed = [r for r in data["rows"] if "meshspeed_ms" in r]
    assert {"dp=2 zero=0", "dp=2 zero=2", "dp=1 tp=2", "dp=1 tp=2 sp"} <= {r["config"] for r in timed}
    # every row compares with something: a peer that fails leaves its row without a ratio
    assert all(r["peer_ms"] and r["ratio"] and not r["error"] for r in timed), timed


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
    args += ["--pp-ep", 2, "--pp-dim", 32, "--pp-seq", 16]
    out = _bench("moe.py", args, ROOT, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    for line in (
        "ep a2a serial",
        "shared-expert overlap (2 shared)",
        "torch._grouped_mm",
        "ep replicate_hot 4",
        "dualpipev overlap",
        "all-to-all time hidden by the overlap",
    ):
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
def test_parallelize_benchmark_runs(tmp_path):
    """benchmarks/parallelize.py end to end at toy sizes: DDP, FSDP2 and meshspeed.parallelize
    (ZeRO-1, ZeRO-3, chunked loss) on the same transformers Llama compute the same losses, and
    the chunked loss's step holds fewer bytes than the same ZeRO-1 step with full logits."""
    rows_file = tmp_path / "rows.json"
    args = ["--layers", "2", "--dim", "64", "--vocab", "2048", "--seq-len", "64", "--steps", "1"]
    args += ["--rounds", "1", "--json", str(rows_file)]
    out = _bench("parallelize.py", args, tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "x DDP" in out.stdout and "LOSS MISMATCH" not in out.stdout, out.stdout
    rows = {r["side"]: r for r in json.load(open(rows_file))["rows"]}
    assert set(rows) == {"ddp", "fsdp2", "ms_z1", "ms_z3", "ms_z1_chunked"}
    assert all(r["loss_ok"] and r["step_ms"] > 0 for r in rows.values()), rows
    assert rows["ms_z1_chunked"]["peak_bytes"] < rows["ms_z1"]["peak_bytes"], rows


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


@pytest.mark.slow
def test_vlm_benchmark_runs(tmp_path):
    """benchmarks/vlm.py end to end at toy sizes on 2 ranks: every layout trains in the real
    trainer, has a measured peak and the planner's prediction beside it."""
    rows_file = tmp_path / "rows.json"
    args = ["--nproc", 2, "--batch", 4, "--micro", 2, "--steps", 1, "--warmup", 0, "--json", str(rows_file)]
    out = _bench("vlm.py", args, tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "meas/pred" in out.stdout, out.stdout
    rows = {r["layout"]: r for r in json.load(open(rows_file))["rows"]}
    assert set(rows) == {"one mesh", "colocated", "disagg 1+1"}, rows
    for r in rows.values():
        assert r["step_ms"] > 0 and r["pred_ms"] > 0, r
        assert r["peak_bytes"] > 0 and r["pred_bytes"] > 0, r
