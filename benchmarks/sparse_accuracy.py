"""Accuracy evidence for dynamic sparse training: a preset (default `small`) on the embedded
corpus, trained dense and sparse for one fixed token budget (same seed, steps, data and
learning-rate schedule) through `meshspeed train`, then a table of final validation loss against
dense, with the tokens and steps used, and speed.

  dense                no masks
  nm-static            2:4 from init: one-shot magnitude mask at the start, never updated
  nm-dynamic           2:4, SR-STE, masks recomputed from |W| every --update-interval steps
  nm-cosine            2:4 dynamic under the cosine schedule: the sparse fraction of layers ramps
                       0 -> 100% over the first half of training
  nm-cosine-finish     the same, then the last --finish steps dense again
  elastic              1:4 for the first half, then 2:4 (masks re-derived, growth by |grad|)
  rigl50, rigl80       unstructured RigL at 50% / 80% (not in the default set)

Sparsity covers the attention and MLP projections (the default `sparsity.layers`); embeddings,
norms and the output layer stay dense, so "sparsity" is of those projections (86% of the
tiny model's parameters). On a CPU the sparse runs take the dense-masked path (no 2:4 kernels),
so their speed shows the mask overhead, not a speed-up; benchmarks/sparse_linear.py times the
kernels on CUDA.

    python -m benchmarks.sparse_accuracy [--preset small] [--steps 120] [--nproc 1] [--runs dense,elastic]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from benchmarks import harness

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
    "nm-cosine": (
        "2:4 dynamic, cosine schedule",
        [
            "--sparsity.pattern",
            "2:4",
            "--sparsity.method",
            "sr-ste",
            "--sparsity.schedule",
            "cosine",
            "--sparsity.update_interval",
            "{interval}",
        ],
    ),
    "nm-cosine-finish": (
        "2:4 dynamic, cosine, dense finish",
        [
            "--sparsity.pattern",
            "2:4",
            "--sparsity.method",
            "sr-ste",
            "--sparsity.schedule",
            "cosine",
            "--sparsity.update_interval",
            "{interval}",
            "--sparsity.dense_finish_steps",
            "{finish}",
        ],
    ),
    "elastic": (
        "elastic 1:4 -> 2:4 at half",
        [
            "--sparsity.pattern",
            "1:4",
            "--sparsity.pattern_schedule",
            "0:1:4,{half}:2:4",
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
    fill = dict(never=args.steps + 1, interval=args.update_interval, finish=args.finish, half=args.steps // 2)
    extra = [a.format(**fill) for a in extra]
    run_dir = os.path.join(out_dir, key)
    argv = ["--nproc", str(args.nproc), "--parallel.tp", "1", "--model.preset", args.preset]
    argv += [
        "--train.global_batch_size",
        str(args.batch),
        "--train.micro_batch_size",
        str(args.batch // args.nproc),
    ]
    argv += ["--train.seq_len", str(args.seq_len), "--train.eval_batches", str(args.eval_batches)]
    argv += ["--train.steps", str(args.steps), "--train.seed", str(args.seed), "--train.eval_interval", "0"]
    argv += ["--run.log_interval", str(args.steps), *extra]
    t0 = time.perf_counter()
    rows = harness.meshspeed_train(argv, run_dir, what=key)
    wall = time.perf_counter() - t0
    tokens = args.batch * args.seq_len
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
        "tokens": tokens * len(rows),
        "steps": len(rows),
        "load": os.getloadavg()[0],
    }


def table(results: list[dict]) -> str:
    dense = next((r for r in results if r["key"] == "dense"), None)
    headers = [
        "run",
        "sparsity",
        "val loss",
        "vs dense",
        "tokens",
        "steps",
        "tokens/s",
        "train s",
        "wall s",
        "load",
    ]
    cells = []
    for r in results:
        delta = f"{r['val_loss'] - dense['val_loss']:+.4f}" if dense else "-"
        cells.append(
            [
                r["label"],
                f"{r['sparsity']:.3f}",
                f"{r['val_loss']:.4f}",
                delta,
                f"{r['tokens']:,}",
                str(r["steps"]),
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
    p.add_argument("--preset", default="small", help="model preset (default small)")
    p.add_argument("--steps", type=int, default=120, help="training steps of every run (default 120)")
    p.add_argument("--batch", type=int, default=8, help="global batch in sequences (default 8)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--eval-batches", type=int, default=8, help="validation batches (default 8)")
    p.add_argument("--finish", type=int, default=20, help="dense-finish steps of nm-cosine-finish")
    p.add_argument("--nproc", type=int, default=1, help="worker processes, data parallel (default 1)")
    p.add_argument("--update-interval", type=int, default=10, help="mask update interval of the dynamic runs")
    p.add_argument("--seed", type=int, default=0)
    default = "dense,nm-static,nm-dynamic,nm-cosine,nm-cosine-finish,elastic"
    p.add_argument("--runs", default=default, help=f"comma-separated subset of {', '.join(RUNS)}")
    p.add_argument("--out", default=None, help="run directory root (default: a temporary directory)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    keys = [k.strip() for k in args.runs.split(",") if k.strip()]
    bad = [k for k in keys if k not in RUNS]
    if bad:
        p.error(f"unknown run(s) {', '.join(bad)}; choose from {', '.join(RUNS)}")
    harness.require_positive(p, args, "steps", "batch", "seq_len", "eval_batches", "nproc", "update_interval")
    from meshspeed.models.presets import PRESETS

    if args.preset not in PRESETS:
        p.error(f"--preset {args.preset}: not a preset; choose from {', '.join(PRESETS)}")
    if args.batch % args.nproc:
        p.error(f"--batch {args.batch}: must be a multiple of --nproc {args.nproc}")
    if "nm-cosine-finish" in keys and not 0 <= args.finish < args.steps:
        p.error(f"--finish {args.finish}: the dense finish must be 0 to --steps - 1 ({args.steps - 1})")
    print(
        f"{args.preset} preset, embedded corpus, {args.steps} steps, "
        f"global batch {args.batch} x {args.seq_len} tokens "
        f"({args.steps * args.batch * args.seq_len:,} tokens), seed {args.seed}, "
        f"{args.nproc} worker(s) (dp {args.nproc}), {os.cpu_count()} CPU core(s); dynamic masks every "
        f"{args.update_interval} steps",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = args.out or tmp
        results = []
        for i, k in enumerate(keys, 1):  # a run is a whole `meshspeed train`: minutes at the defaults
            print(f"  [{i}/{len(keys)}] {k}: {args.steps} steps ...", flush=True)
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
