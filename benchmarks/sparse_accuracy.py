"""Accuracy evidence for dynamic sparse training: the tiny preset on the default corpus, trained
dense and sparse with the same seed, steps, data and learning-rate schedule, through `meshspeed
train` (spawned workers), then a table of final validation loss and speed.

  dense          no masks
  2:4 static     one-shot magnitude 2:4 mask at the start, never updated
  2:4 dynamic    2:4 masks recomputed from |W| every --update-interval steps, SR-STE decay
  RigL 50%       unstructured, 50% sparse, drop-and-grow every --update-interval steps
  RigL 80%       the same at 80%

Sparsity covers the attention and MLP projections (the default `sparsity.layers`); embeddings,
norms and the output layer stay dense, so "sparsity" is of those projections (86% of the
tiny model's parameters). On a CPU the sparse runs take the dense-masked path (no 2:4 kernels),
so their speed shows the mask overhead, not a speed-up; benchmarks/sparse_linear.py times the
kernels on CUDA.

    python benchmarks/sparse_accuracy.py [--steps 200] [--nproc 2] [--runs dense,rigl50]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RUNS = {
    "dense": ("dense", []),
    "nm-static": (
        "2:4 static (one-shot magnitude)",
        [
            "--sparsity.pattern",
            "2:4",
            "--sparsity.method",
            "magnitude",
            "--sparsity.update_interval",
            "{never}",
        ],
    ),
    "nm-dynamic": (
        "2:4 dynamic (SR-STE, recomputed)",
        [
            "--sparsity.pattern",
            "2:4",
            "--sparsity.method",
            "sr-ste",
            "--sparsity.update_interval",
            "{interval}",
        ],
    ),
    "rigl50": (
        "unstructured RigL 50%",
        [
            "--sparsity.pattern",
            "unstructured",
            "--sparsity.target",
            "0.5",
            "--sparsity.method",
            "rigl",
            "--sparsity.update_interval",
            "{interval}",
        ],
    ),
    "rigl80": (
        "unstructured RigL 80%",
        [
            "--sparsity.pattern",
            "unstructured",
            "--sparsity.target",
            "0.8",
            "--sparsity.method",
            "rigl",
            "--sparsity.update_interval",
            "{interval}",
        ],
    ),
}


def run_one(key: str, args, out_dir: str) -> dict:
    label, extra = RUNS[key]
    extra = [a.format(never=args.steps + 1, interval=args.update_interval) for a in extra]
    run_dir = os.path.join(out_dir, key)
    cmd = [
        sys.executable,
        "-m",
        "meshspeed",
        "train",
        "--nproc",
        str(args.nproc),
        "--parallel.tp",
        "1",
        "--model.preset",
        "tiny",
        "--train.steps",
        str(args.steps),
        "--train.seed",
        str(args.seed),
        "--train.eval_interval",
        "0",
        "--run.dir",
        run_dir,
        "--run.log_interval",
        str(args.steps),
    ] + extra
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if out.returncode:
        raise SystemExit(f"{key} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    tokens = 16 * 128  # the tiny preset's global batch x sequence length (trainer defaults)
    steady = [r["tokens_per_s"] for r in rows[3:]]  # the first steps pay for warm-up
    return {
        "key": key,
        "label": label,
        "val_loss": rows[-1]["val_loss"],
        "train_loss": rows[-1]["loss"],
        "sparsity": rows[-1].get("sparsity", 0.0),
        "flip_rate": [r["flip_rate"] for r in rows if "flip_rate" in r],
        "tokens_per_s": sum(steady) / len(steady),
        "train_s": sum(tokens / r["tokens_per_s"] for r in rows),
        "wall_s": wall,
        "load": os.getloadavg()[0],
    }


def table(results: list[dict]) -> str:
    dense = next((r for r in results if r["key"] == "dense"), None)
    headers = ["run", "sparsity", "val loss", "vs dense", "tokens/s", "train s", "wall s", "load"]
    cells = []
    for r in results:
        delta = f"{r['val_loss'] - dense['val_loss']:+.4f}" if dense else "-"
        cells.append(
            [
                r["label"],
                f"{r['sparsity']:.3f}",
                f"{r['val_loss']:.4f}",
                delta,
                f"{r['tokens_per_s']:,.0f}",
                f"{r['train_s']:.1f}",
                f"{r['wall_s']:.1f}",
                f"{r['load']:.1f}",
            ]
        )
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    fmt = "  ".join(f"{{:<{widths[0]}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    lines = [fmt.format(*headers), fmt.format(*("-" * w for w in widths))]
    return "\n".join(lines + [fmt.format(*c) for c in cells])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="training steps of every run (default 200)")
    p.add_argument("--nproc", type=int, default=2, help="worker processes, data parallel (default 2)")
    p.add_argument("--update-interval", type=int, default=10, help="mask update interval of the dynamic runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {', '.join(RUNS)}")
    p.add_argument("--out", default=None, help="run directory root (default: a temporary directory)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    keys = [k.strip() for k in args.runs.split(",") if k.strip()]
    bad = [k for k in keys if k not in RUNS]
    if bad:
        p.error(f"unknown run(s) {', '.join(bad)}; choose from {', '.join(RUNS)}")
    print(
        f"tiny preset, default corpus, {args.steps} steps, global batch 16 x 128 tokens, seed {args.seed}, "
        f"{args.nproc} worker(s) (dp {args.nproc}), {os.cpu_count()} CPU core(s); dynamic masks every "
        f"{args.update_interval} steps",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = args.out or tmp
        results = []
        for k in keys:
            results.append(run_one(k, args, out_dir))
            r = results[-1]
            print(f"  {r['label']}: val loss {r['val_loss']:.4f} in {r['wall_s']:.0f}s", flush=True)
    print()
    print(table(results))
    print(
        "\nsparsity: of the masked projections (attention + MLP); tokens/s: mean over steps after the 3rd;"
        "\ntrain s: sum of step times; wall s: the whole `meshspeed train` process "
        "(start-up, eval, checkpoint);"
        "\nload: the machine's 1-minute load average after the run "
        "(other work on the cores makes speeds noisy)."
        "\nCPU: dense-masked path everywhere (no sparse kernels), so sparse runs cannot be faster here."
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
