"""The planner's predictions against measured steps: every layout it considers, trained for real.

    python -m benchmarks.planner [--nproc 4] [--preset tiny] [--steps 8] [--layouts 10]

Ranks the layouts for the preset at --nproc ranks on this machine (`--device calibrated` when
`meshspeed plan --calibrate` has stored this machine's rates, else the built-in `cpu`), then
runs each of the first --layouts with `meshspeed train` and reads the steady-state tokens/s from
its metrics (the median of the steps after the first two). Prints predicted and measured step
time per layout, the Spearman rank correlation between them, and where the planner's first
choice ranks among the measured ones. Timings on a shared machine are noisy: run it idle.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from meshspeed.plan import config
from meshspeed.plan.machine import get_machine
from meshspeed.plan.planner import rank_layouts, settings_args


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation (no ties expected among measured times)."""

    def ranks(xs):
        order = sorted(range(len(xs)), key=xs.__getitem__)
        r = [0] * len(xs)
        for i, j in enumerate(order):
            r[j] = i
        return r

    ra, rb, n = ranks(a), ranks(b), len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def measure(settings: dict, args) -> float | None:
    """Median seconds per step of `meshspeed train` with these settings (None if it failed)."""
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, "-m", "meshspeed", "train", "--nproc", str(args.nproc)]
        cmd += ["--model.preset", args.preset, "--train.steps", str(args.steps)]
        cmd += ["--train.global_batch_size", str(args.batch), "--train.seq_len", str(args.seq)]
        cmd += ["--run.dir", run_dir, "--run.log_interval", "1", "--checkpoint.interval", "0"]
        cmd += settings_args(settings).split()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        path = os.path.join(run_dir, "metrics.jsonl")
        if done.returncode or not os.path.exists(path):
            print(f"  failed: {done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            return None
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        rates = [r["tokens_per_s"] for r in rows if r.get("tokens_per_s")][2:]
        if not rates:
            return None
        return args.batch * args.seq / statistics.median(rates)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--layouts", type=int, default=10, help="layouts to run (the planner's first N)")
    ap.add_argument(
        "--device", default=None, help="machine for the predictions (default: calibrated, else cpu)"
    )
    args = ap.parse_args()
    cfg = config.load(
        None,
        [
            ("model.preset", args.preset),
            ("train.global_batch_size", str(args.batch)),
            ("train.seq_len", str(args.seq)),
        ],
    )
    name = args.device or ("calibrated" if os.path.exists(_calibration()) else "cpu")
    machine = get_machine(name)
    ok, _ = rank_layouts(cfg, args.nproc, machine, {"parallel.cp": 1})
    # spread over the ranking, not only its head, so the correlation sees good and bad layouts
    step = max(1, len(ok) // args.layouts)
    chosen = ok[::step][: args.layouts]
    print(f"planner: {args.preset}, {args.nproc} ranks, machine {machine.name}; {len(ok)} layouts fit")
    print(f"{'#':>2} {'predicted ms':>12} {'measured ms':>12}  layout")
    pred, meas, rows = [], [], []
    for i, r in enumerate(chosen):
        t = measure(r["settings"], args)
        p = r["predicted"]["step_s"]
        short = {k.split(".")[1]: v for k, v in r["settings"].items() if k != "parallel.sequence_parallel"}
        print(f"{i + 1:>2} {p * 1e3:12.1f} {t * 1e3 if t else float('nan'):12.1f}  {short}", flush=True)
        if t:
            pred.append(p)
            meas.append(t)
            rows.append(r)
    if len(meas) < 3:
        print("planner: too few layouts ran to compare", file=sys.stderr)
        return 1
    rho = spearman(pred, meas)
    best_measured = min(meas)
    first = meas[0]  # chosen[0] is the planner's first choice
    rank = sorted(meas).index(first) + 1
    print(
        f"Spearman rank correlation (predicted vs measured): {rho:.2f} over {len(meas)} layouts; "
        f"the planner's first choice measured {first / best_measured:.2f}x the best (rank {rank})"
    )
    return 0


def _calibration() -> str:
    from meshspeed.plan.machine import calibration_path

    return calibration_path()


if __name__ == "__main__":
    raise SystemExit(main())
