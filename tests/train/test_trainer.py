"""The trainer end to end: every layout's float32 losses equal one process's; resume is exact.

The acceptance layouts (tp 2, tp 4, dp 2 × tp 2 with sequence parallelism, dp 4 with ZeRO-1
and ZeRO-2, the MoE preset under dp 2 × tp 2, the Qwen2 family under tp 2, pp 2 and dp 2
ZeRO-1) each run 10 steps in the pooled gloo workers and
are compared with the same 10 steps in one process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from meshspeed.plan import config
from meshspeed.train.trainer import Trainer
from tests import cli_batch, harness

# Same model for every layout: 4 query and 4 kv heads so tp 4 divides them.
BASE = [
    ("model.n_heads", "4"),
    ("model.n_kv_heads", "4"),
    ("train.seq_len", "32"),
    ("train.global_batch_size", "8"),
    ("train.micro_batch_size", "2"),
    ("train.dtype", "float32"),
    ("train.eval_interval", "0"),
    ("train.warmup_steps", "3"),
    ("data.max_mb", "1"),
]


def _cfg(run_dir: str, extra: list[tuple[str, str]]) -> config.Config:
    return config.load(None, BASE + [("run.dir", run_dir)] + extra)


def job_losses(ctx, run_dir: str, extra: list, steps: int):
    trainer = Trainer(_cfg(run_dir, extra + [("train.steps", str(steps))]), ctx)
    return [trainer.train_step(s)["loss"] for s in range(steps)]


def job_rows(ctx, run_dir: str, extra: list, steps: int) -> tuple[list, list]:
    """(losses, gradient norms) of `steps` steps. Under AdamW a uniform scale error on the
    gradients barely moves the losses (the update divides it out); the norm shows it."""
    trainer = Trainer(_cfg(run_dir, extra + [("train.steps", str(steps))]), ctx)
    rows = [trainer.train_step(s) for s in range(steps)]
    return [r["loss"] for r in rows], [r["grad_norm"] for r in rows]


# grad_norm at 1e-4: the float32 norm of a whole flat bucket is itself only good to ~2e-5 on
# CPU, and layouts cut the buckets differently (tests/parallel/test_pipeline_runtime.py)
NORM_REL = 1e-4


def assert_rows_close(got: list, want: tuple, name: str, loss_rel: float = 1e-5, norm_rel: float = NORM_REL):
    """Every rank's (losses, norms) equal, and equal to `want` within the relative bounds."""
    assert all(r == got[0] for r in got), f"{name}: ranks disagree on the loss or the gradient norm"
    for what, rel, g_all, w_all in (
        ("loss", loss_rel, got[0][0], want[0]),
        ("grad_norm", norm_rel, got[0][1], want[1]),
    ):
        assert len(g_all) == len(w_all), name
        for step, (g, w) in enumerate(zip(g_all, w_all)):
            assert abs(g - w) <= rel * abs(w), f"{name} step {step} {what}: {g} vs single-process {w}"


def job_run(ctx, run_dir: str, extra: list):
    """A whole `Trainer.run()` (metrics, checkpoints, exit/resume) as the CLI would do it."""
    return Trainer(_cfg(run_dir, extra), ctx).run()["checkpoint"]


_REFERENCE: dict = {}


def _reference(tmp_path_factory, preset: str) -> tuple[list, list]:
    if preset not in _REFERENCE:
        run_dir = str(tmp_path_factory.mktemp(f"ref-{preset}"))
        extra = [("model.preset", preset), ("parallel.tp", "1")]
        if preset == "tiny-moe":
            extra = [("model.preset", preset), ("parallel.tp", "1"), ("model.n_kv_heads", "2")]
        _REFERENCE[preset] = harness.run(1, job_rows, run_dir, extra, 10)[0]
    return _REFERENCE[preset]


LAYOUTS = [
    ("tp2", 2, [("parallel.tp", "2")], "tiny"),
    ("tp4", 4, [("parallel.tp", "4")], "tiny"),
    ("dp2-tp2-sp", 4, [("parallel.tp", "2"), ("parallel.sequence_parallel", "true")], "tiny"),
    ("dp4-zero1", 4, [("parallel.tp", "1"), ("parallel.zero", "1")], "tiny"),
    ("dp4-zero2", 4, [("parallel.tp", "1"), ("parallel.zero", "2")], "tiny"),
    (
        "moe-dp2-tp2",
        4,
        [("parallel.tp", "2"), ("model.preset", "tiny-moe"), ("model.n_kv_heads", "2")],
        "tiny-moe",
    ),
    # A family added with no change in meshspeed/parallel (q/k/v biases split with their columns).
    ("qwen2-tp2", 2, [("parallel.tp", "2"), ("model.preset", "tiny-qwen2")], "tiny-qwen2"),
    (
        "qwen2-pp2",
        2,
        [("parallel.tp", "1"), ("parallel.pp", "2"), ("model.preset", "tiny-qwen2")],
        "tiny-qwen2",
    ),
    (
        "qwen2-dp2-zero1",
        2,
        [("parallel.tp", "1"), ("parallel.zero", "1"), ("model.preset", "tiny-qwen2")],
        "tiny-qwen2",
    ),
]


@pytest.mark.parametrize("name,ws,extra,preset", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_first_ten_losses_equal_single_process(tmp_path_factory, name, ws, extra, preset):
    want = _reference(tmp_path_factory, preset)
    got = harness.run(ws, job_rows, str(tmp_path_factory.mktemp(name)), extra, 10)
    assert_rows_close(got, want, name)
    losses = want[0]
    assert losses[-1] < losses[0] - 0.5  # it is learning, so equality is not trivially about constants


def _losses(run_dir) -> list[float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


def test_resumed_run_equals_uninterrupted_run(tmp_path):
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    layout = [("parallel.tp", "2"), ("train.steps", "20")]
    harness.run(4, job_run, straight, layout)
    ckpt = harness.run(4, job_run, split, layout + [("train.exit_interval", "10")])[0]
    assert ckpt.endswith("step-000010") and len(_losses(split)) == 10
    harness.run(4, job_run, split, layout + [("checkpoint.resume", "latest")])
    assert _losses(split) == _losses(straight)  # bit-identical: same layout, same operations
    assert len(_losses(straight)) == 20


def test_tp2_checkpoint_resumes_under_tp1(tmp_path):
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    harness.run(2, job_run, straight, [("parallel.tp", "2"), ("train.steps", "14")])
    harness.run(
        2, job_run, split, [("parallel.tp", "2"), ("train.steps", "14"), ("train.exit_interval", "7")]
    )
    harness.run(
        1, job_run, split, [("parallel.tp", "1"), ("train.steps", "14"), ("checkpoint.resume", "latest")]
    )
    a, b = _losses(straight), _losses(split)
    assert len(a) == len(b) == 14
    for step, (x, y) in enumerate(zip(a, b)):
        assert abs(x - y) <= 1e-5 * abs(x), f"step {step}: resumed under tp 1 {y} vs tp 2 {x}"


def test_cli_trains_and_reports(tmp_path):
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshspeed",
            "train",
            "--train.steps",
            "6",
            "--train.seq_len",
            "32",
            "--train.eval_interval",
            "3",
            "--data.max_mb",
            "1",
            "--run.dir",
            str(tmp_path / "run"),
            "--checkpoint.export_safetensors",
            "true",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "dp 2 × tp 2" in out.stdout and "final train loss" in out.stdout and "tokens/s" in out.stdout
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(6))
    assert set(rows[0]) >= {"step", "loss", "lr", "grad_norm", "tokens_per_s"}
    assert "val_loss" in rows[2] and "val_loss" in rows[5] and "val_loss" not in rows[0]
    assert (tmp_path / "run" / "model.safetensors").exists()
    assert (tmp_path / "run" / "step-000006" / "COMPLETE").exists()
    # the loss curve is drawn with matplotlib (the dev extra); a minimal install writes none
    assert (tmp_path / "run" / "loss.png").exists() == (importlib.util.find_spec("matplotlib") is not None)


BAD_SETTINGS = [
    (["--parallel.tp", "3"], "parallel.tp=3 × parallel.pp=1 = 3 does not divide the world size 4"),
    (
        ["--train.global_batch_size", "12"],
        "train.global_batch_size=12 is not divisible by train.micro_batch_size × parallel.dp",
    ),
    (["--parallel.zero", "4"], "parallel.zero='4' is not valid; choose one of 0, 1, 2"),
    (["--train.dtype", "fp8"], "train.dtype='fp8' is not valid"),
]
_BAD: dict = {}


@pytest.mark.parametrize("args,needle", BAD_SETTINGS)
def test_cli_bad_settings_fail_with_one_line(tmp_path_factory, args, needle):
    if not _BAD:  # all cases in one interpreter (tests/cli_batch.py): one torch import, not four
        argvs = [["train", *a] for a, _ in BAD_SETTINGS]
        for a, res in zip(BAD_SETTINGS, cli_batch.run_many(argvs, tmp_path_factory.mktemp("bad"))):
            _BAD[tuple(a[0])] = res
    out = _BAD[tuple(args)]
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], out.stderr


def test_cli_resume_without_checkpoint_is_one_clear_error(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshspeed",
            "train",
            "--nproc",
            "2",
            "--checkpoint.resume",
            "latest",
            "--run.dir",
            str(tmp_path / "empty"),
            "--data.max_mb",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 1
    assert "checkpoint.resume=latest but" in out.stderr and "holds no complete checkpoint" in out.stderr
    assert "Traceback" not in out.stderr
