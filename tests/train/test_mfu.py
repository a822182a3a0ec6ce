"""MFU in the metrics: the device table, the override, null where the peak is unknown."""

from __future__ import annotations

import json

import pytest

from meshspeed.models import get_preset
from meshspeed.models.flops import flops_per_token
from meshspeed.train.metrics import MetricsLogger, device_peak_tflops, mfu, peak_flops
from tests import harness


def test_device_table_matches_names_and_unknown_is_none():
    assert device_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert device_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert device_peak_tflops("NVIDIA A100-SXM4-40GB") == 312.0
    assert device_peak_tflops("Some Future GPU") is None
    assert device_peak_tflops(None) is None


def test_peak_cpu_is_none_and_override_wins():
    assert peak_flops("cpu", 4) is None
    assert peak_flops("cpu", 4, override_tflops=2.0) == pytest.approx(8e12)
    with pytest.raises(ValueError, match="train.peak_tflops=0"):
        peak_flops("cpu", 1, override_tflops=0)


def test_mfu_is_model_flops_over_peak():
    config = get_preset("tiny")
    fpt = flops_per_token(config, 64)
    # Model FLOP/s over the whole run's peak: 1000 tok/s on 2 devices of 1 TFLOP/s each.
    assert mfu(1000.0, fpt, 2e12) == pytest.approx(1000.0 * fpt / 2e12)
    assert mfu(1000.0, fpt, None) is None


def test_logger_writes_mfu_and_progress(tmp_path, capsys):
    fpt = 6e6
    log = MetricsLogger(str(tmp_path), 3, True, log_interval=1, flops_per_token=fpt, peak=1e12)
    for step, tps in enumerate((100.0, 200.0, 300.0)):
        log.log({"step": step, "loss": 1.0, "lr": 1e-3, "tokens_per_s": tps})
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["mfu"] for r in rows] == pytest.approx([tps * fpt / 1e12 for tps in (100.0, 200.0, 300.0)])
    assert f"MFU {300.0 * fpt / 1e12:.1%}" in capsys.readouterr().err
    assert log.mean_mfu(skip=1) == pytest.approx((200.0 + 300.0) * fpt / 2e12)

    # Unknown peak (CPU, no override): null in the file, "n/a" in the line, no mean.
    log = MetricsLogger(str(tmp_path / "cpu"), 1, True, log_interval=1, flops_per_token=fpt, peak=None)
    log.log({"step": 0, "loss": 1.0, "lr": 1e-3, "tokens_per_s": 100.0})
    row = json.loads(open(tmp_path / "cpu" / "metrics.jsonl").readline())
    assert "mfu" in row and row["mfu"] is None
    assert "MFU n/a" in capsys.readouterr().err
    assert log.mean_mfu(skip=0) is None


def job_mfu_rows(ctx, run_dir: str, peak: str) -> tuple[list[dict], float | None, float]:
    from meshspeed.train.trainer import Trainer
    from tests.train.test_trainer import _cfg

    extra = [("parallel.tp", "1"), ("train.steps", "5"), ("train.peak_tflops", peak)]
    trainer = Trainer(_cfg(run_dir, extra), ctx)
    summary = trainer.run()
    rows = [json.loads(line) for line in open(summary["metrics"])]
    return rows, summary["mfu"], flops_per_token(trainer.model_config, trainer.cfg.train.seq_len)


def test_trainer_reports_mfu(tmp_path):
    # CPU without a peak: the key is there and null, as is the summary's.
    rows, summary_mfu, _ = harness.run(1, job_mfu_rows, str(tmp_path / "cpu"), "0")[0]
    assert all("mfu" in r and r["mfu"] is None for r in rows) and summary_mfu is None
    # With train.peak_tflops: tokens/s × FLOPs per token ÷ peak of the run's one device.
    rows, summary_mfu, fpt = harness.run(1, job_mfu_rows, str(tmp_path / "peak"), "0.5")[0]
    for r in rows:
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * fpt / 0.5e12)
    assert summary_mfu == pytest.approx(sum(r["mfu"] for r in rows[3:]) / len(rows[3:]))
