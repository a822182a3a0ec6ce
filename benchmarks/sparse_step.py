"""What a mask update costs a training step, synchronous against `--sparsity.async_masks`, and
the gradient bytes data parallelism sends, dense against `--sparsity.sparse_grad_comm`.

Every run is `meshspeed train` (spawned workers) on the same preset, seed, data and schedule;
step times and counted bytes come from its metrics.jsonl (a row's step time is global batch
tokens / tokens_per_s: forward, backward, reduction, optimizer and the mask work of that step).

  update cost   per mask update: the extra time of the update step and the step after it (async
                computes during that one and installs at its end) over the median step without
                mask work: sum(t[u] + t[u + 1] - 2 * median), averaged over updates. The sync and
                async runs alternate --repeat times; each is printed, then the median.
  grad bytes    grad_comm_bytes per step (payload handed to the dp collectives) at dp --dp, with
                and without sparse_grad_comm, and their ratio; update steps reduce dense in both.

On a 2-core machine the background thread competes with training for the same cores, so
async hides less than it would beside a GPU step; the printed load average says how busy
the machine was.

    python -m benchmarks.sparse_step [--preset small] [--steps 30] [--interval 5] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train(args, run_dir: str, nproc: int, extra: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "meshspeed", "train", "--nproc", str(nproc), "--parallel.tp", "1"]
    cmd += ["--model.preset", args.preset, "--train.steps", str(args.steps), "--train.eval_interval", "0"]
    cmd += [
        "--train.global_batch_size",
        str(args.batch),
        "--train.micro_batch_size",
        str(args.batch // nproc),
    ]
    cmd += ["--train.seq_len", str(args.seq_len), "--train.eval_batches", "1", "--run.dir", run_dir]
    cmd += ["--run.log_interval", str(args.steps), "--sparsity.pattern", "2:4"]
    cmd += ["--sparsity.update_interval", str(args.interval)] + extra
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"meshspeed train failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def timed_steps(steps: int, interval: int) -> tuple[list[int], list[int]]:
    """(update steps whose cost is measured, quiet steps without mask work), 0-based: the first
    3 steps pay for warm-up, and an update's cost spans it and the step after it."""
    updates = [s for s in range(steps) if (s + 1) % interval == 0 and s + 1 < steps]
    busy = {s for u in updates for s in (u, u + 1)}
    return [u for u in updates if u >= 3], [s for s in range(3, steps) if s not in busy]


def update_cost(rows: list[dict], tokens: int, interval: int) -> tuple[float, float]:
    """(mean extra seconds per update, median step seconds without mask work)."""
    t = [tokens / r["tokens_per_s"] for r in rows]
    updates, quiet = timed_steps(len(rows), interval)
    base = statistics.median(t[s] for s in quiet)
    return statistics.mean(t[u] + t[u + 1] - 2 * base for u in updates), base


def check(p: argparse.ArgumentParser, args) -> None:
    """Refuse, before any run, what cannot give a figure (one line naming the fix)."""
    parts = set(args.parts.split(","))
    if not parts or parts - {"update", "bytes"}:
        p.error(f"--parts {args.parts!r}: choose update, bytes or update,bytes")
    for name in ("steps", "interval", "batch", "seq_len", "repeat", "dp"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    if args.batch % args.dp:
        p.error(f"--batch {args.batch} is not a multiple of --dp {args.dp}")
    if "update" in parts:
        updates, quiet = timed_steps(args.steps, args.interval)
        if not updates or not quiet:
            fix = "use --interval 3 or more"  # below 3 every step after warm-up has mask work
            if args.interval > 2:
                need = next(n for n in range(args.steps, 10**6) if all(timed_steps(n, args.interval)))
                fix = f"use --steps {need} or more"
            p.error(
                f"--steps {args.steps} --interval {args.interval}: the update cost needs a mask update "
                f"after the 3 warm-up steps, the step after it, and a step without mask work; {fix}"
            )
    if "bytes" in parts and (args.interval < 2 or args.steps < 2):
        p.error("the grad bytes need steps between mask updates: use --interval 2 and --steps 2 or more")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small", help="model preset (default small)")
    p.add_argument("--steps", type=int, default=30, help="steps per run (default 30)")
    p.add_argument("--interval", type=int, default=5, help="mask update interval (default 5)")
    p.add_argument("--batch", type=int, default=8, help="global batch in sequences (default 8)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--repeat", type=int, default=2, help="sync/async pairs (default 2)")
    p.add_argument("--dp", type=int, default=2, help="data-parallel workers of the bytes runs (default 2)")
    p.add_argument("--parts", default="update,bytes", help="update, bytes or both (default)")
    args = p.parse_args()
    check(p, args)
    tokens = args.batch * args.seq_len
    runs = (2 * args.repeat if "update" in args.parts else 0) + (2 if "bytes" in args.parts else 0)
    done = 0

    def progress(what: str) -> None:  # each run is a whole `meshspeed train`: say which one starts
        nonlocal done
        done += 1
        print(f"  [{done}/{runs}] meshspeed train: {what}, {args.steps} steps ...", flush=True)

    print(
        f"{args.preset} preset, 2:4 transposable masks (magnitude) every {args.interval} steps, {args.steps} "
        f"steps of {args.batch} x {args.seq_len} tokens, {os.cpu_count()} CPU core(s)",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        if "update" in args.parts:
            costs = {"sync": [], "async": []}
            for i in range(args.repeat):
                for mode in ("sync", "async") if i % 2 == 0 else ("async", "sync"):
                    extra = ["--sparsity.async_masks", "true"] if mode == "async" else []
                    progress(f"{mode} masks, run {i}")
                    rows = train(args, os.path.join(tmp, f"{mode}{i}"), 1, extra)
                    cost, base = update_cost(rows, tokens, args.interval)
                    costs[mode].append(cost)
                    print(
                        f"  {mode:>5} run {i}: step {base * 1e3:.0f} ms, "
                        f"mask update costs {cost * 1e3:+.0f} ms "
                        f"(load {os.getloadavg()[0]:.1f})",
                        flush=True,
                    )
            s, a = statistics.median(costs["sync"]), statistics.median(costs["async"])
            print(f"mask update cost (median): sync {s * 1e3:+.0f} ms, async {a * 1e3:+.0f} ms per update")
        if "bytes" in args.parts:
            progress(f"dense gradients at dp {args.dp}")
            dense = train(args, os.path.join(tmp, "dense"), args.dp, [])
            progress(f"sparse_grad_comm at dp {args.dp}")
            packed = train(
                args, os.path.join(tmp, "packed"), args.dp, ["--sparsity.sparse_grad_comm", "true"]
            )
            d = [r["grad_comm_bytes"] for r in dense]
            q = [r["grad_comm_bytes"] for r in packed]
            between = [b / a for a, b, r in zip(d, q, packed) if b != a]
            print(
                f"grad bytes per step at dp {args.dp}: dense {d[0]:,}; sparse_grad_comm {min(q):,} between "
                f"updates, {max(q):,} at update steps; ratio {statistics.mean(between):.3f} between updates, "
                f"{sum(q) / sum(d):.3f} over the run (2:4: 0.5 of the masked weights, the rest whole)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
