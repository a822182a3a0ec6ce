"""What a run reports: metrics.jsonl, TensorBoard (when installed), a progress line, a loss plot.

Only rank 0 writes. metrics.jsonl holds one JSON object per step (step, loss, lr, grad_norm,
tokens_per_s, mfu, and val_loss when measured); it is the record that resume-equality and layout
parity are checked against, so it is flushed every step. A step skipped for a non-finite loss
or gradient norm has "skipped": true and null in place of the non-finite numbers (strict JSON
has no NaN), and from then on every row counts "skipped_steps".

MFU (model FLOPs utilisation) = tokens/s × training FLOPs per token (models/flops.py) ÷ the
peak FLOP/s of all devices of the run: `train.peak_tflops` per device when given, else the
device's dense bf16 peak from PEAK_TFLOPS. Without either (a CPU, an unlisted GPU) it is null:
no number is made up.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time


def lr_at(step: int, *, lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to `lr`, then cosine decay to lr·min_ratio at `total` (a pure function of
    the step, so a resumed run follows the same schedule)."""
    if warmup and step < warmup:
        return lr * (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


# Dense bf16 tensor-core peak per device, TFLOP/s, from the vendors' data sheets (no sparsity).
# Matched against torch.cuda.get_device_name() in order: the first listed substring found wins.
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("B200", 2250.0),
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),  # SXM / NVL
    ("GH200", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("RTX 4090", 165.0),
    ("MI300X", 1307.0),
)


def device_peak_tflops(device_name: str | None) -> float | None:
    """Peak dense bf16 TFLOP/s of a device named as torch.cuda.get_device_name() names it;
    None for an unknown device or a CPU (None)."""
    if not device_name:
        return None
    return next((v for k, v in PEAK_TFLOPS if k.lower() in device_name.lower()), None)


def peak_flops(device, n_devices: int, override_tflops: float | None = None) -> float | None:
    """FLOP/s of the whole run at peak: override (per device) or the table's, × n_devices."""
    if override_tflops is not None:
        if not override_tflops > 0:
            raise ValueError(
                f"train.peak_tflops={override_tflops} must be > 0 (TFLOP/s of one device); "
                "leave it unset to use the table of known devices"
            )
        per = override_tflops
    else:
        import torch

        dev = torch.device(device)
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" and torch.cuda.is_available() else None
        per = device_peak_tflops(name)
    return None if per is None else per * 1e12 * n_devices


def mfu(tokens_per_s: float, flops_per_token: float, peak: float | None) -> float | None:
    """Fraction of peak the model's FLOPs reach; None when the peak is unknown."""
    return None if peak is None or tokens_per_s is None else tokens_per_s * flops_per_token / peak


def _finite_or_none(row: dict) -> dict:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}


def _fmt(v, spec: str) -> str:
    return "nan" if v is None else format(v, spec)


class MetricsLogger:
    def __init__(
        self,
        run_dir: str,
        total_steps: int,
        enabled: bool,
        log_interval: int = 10,
        resume_step: int = 0,
        flops_per_token: float | None = None,
        peak: float | None = None,
    ):
        """flops_per_token (models/flops.py) and peak (peak_flops: the whole run's FLOP/s)
        turn on the mfu column; peak None with flops given logs mfu null."""
        self.enabled, self.total, self.log_interval = enabled, total_steps, log_interval
        self.flops_per_token, self.peak = flops_per_token, peak
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.tty = sys.stderr.isatty()
        self.t_start = time.monotonic()
        self.start_step = resume_step
        self.rows: list[dict] = []
        self._tb = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        # On resume keep the rows before the resume point and drop any written after it by the
        # interrupted run, so the file reads as one uninterrupted run.
        kept = []
        if resume_step and os.path.exists(self.path):
            with open(self.path) as f:
                kept = [r for r in map(json.loads, f) if r["step"] < resume_step]
        self.rows = kept
        with open(self.path, "w") as f:
            for r in kept:
                f.write(json.dumps(r) + "\n")
        try:  # TensorBoard is optional: use it when the package is there
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(run_dir, "tb"))
        except Exception:  # noqa: BLE001 - ImportError, or tensorboard's own import errors
            self._tb = None

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        if self.flops_per_token is not None and "tokens_per_s" in row and "mfu" not in row:
            row = {**row, "mfu": mfu(row["tokens_per_s"], self.flops_per_token, self.peak)}
        row = _finite_or_none(row)
        self.rows.append(row)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, row["step"])
        self._progress(row)

    def _progress(self, row: dict) -> None:
        step = row["step"] + 1
        done = step - self.start_step
        elapsed = time.monotonic() - self.t_start
        eta = elapsed / max(done, 1) * (self.total - step)
        val = f" val {_fmt(row['val_loss'], '.4f')}" if "val_loss" in row else ""
        val += " (update skipped: not finite)" if row.get("skipped") else ""
        val += f" experts max/mean {row['expert_load']:.2f}" if row.get("expert_load") else ""
        width = 24
        filled = int(width * step / self.total)
        loss = _fmt(row["loss"], ".4f")
        line = (
            f"[{'#' * filled}{'.' * (width - filled)}] step {step}/{self.total} loss {loss}{val} "
            f"lr {row['lr']:.2e} {row['tokens_per_s']:,.0f} tok/s{self._mfu_text(row)} ETA {eta:4.0f}s"
        )
        if self.tty:
            print(f"\r{line}", end="\n" if step == self.total else "", file=sys.stderr, flush=True)
        elif step % self.log_interval == 0 or step == self.total or "val_loss" in row:
            print(line, file=sys.stderr, flush=True)

    @staticmethod
    def _mfu_text(row: dict) -> str:
        if "mfu" not in row:
            return ""
        return " MFU n/a" if row["mfu"] is None else f" MFU {row['mfu']:.1%}"

    def mean_mfu(self, skip: int = 1) -> float | None:
        """Mean MFU over the steps after the first `skip` (warmup) logged this run; None when
        MFU is off or the peak is unknown."""
        vals = [r.get("mfu") for r in self.rows if r["step"] >= self.start_step + skip]
        vals = [v for v in vals if v is not None]
        return sum(vals) / len(vals) if vals else None

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()

    def plot(self, path: str) -> str | None:
        """Loss curve (train per step, validation where measured). None without matplotlib."""
        if not self.enabled or not self.rows:
            return None
        try:
            # the figure and the Agg canvas directly, not pyplot: no global figure registry or
            # backend switch in a process that may be someone's notebook
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError:
            return None
        fig = Figure(figsize=(8, 4.5))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        nan = float("nan")  # a skipped step's null loss: a gap in the curve
        ax.plot(
            [r["step"] for r in self.rows],
            [nan if r["loss"] is None else r["loss"] for r in self.rows],
            label="train",
            linewidth=1,
        )
        val = [r for r in self.rows if r.get("val_loss") is not None]
        if val:
            ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
        # fixed margins: tight_layout measures every label first, half the drawing time here
        fig.subplots_adjust(left=0.09, right=0.98, top=0.97, bottom=0.12)
        fig.savefig(path, dpi=110)
        return path
