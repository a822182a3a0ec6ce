"""Pipeline schedules on real CPU workers: measured bubble vs the simulator, and meshspeed's
runtime vs torch.distributed.pipelining, side by side in one run.

Spawns --pp local gloo workers (one pipeline rank each, one torch thread each), builds the
same seeded model split the same way for every variant, and times forward + backward of
one global batch of --microbatches micro-batches (no optimizer step: it is not part of what
a schedule decides).

Part 1, bubble: for each schedule the runtime records every action's start and end on every
rank (common origin after a barrier). Of the --steps timed steps, the median-makespan one is
reported: its measured bubble (idle / (pp * makespan)), and the bubble the simulator predicts
for the same schedule fed the measured mean F / B / W times and p2p delivery time (and with
p2p = 0), plus the unit-cost closed form. Measured minus simulated is what the costs do not
explain: Python overhead between actions, p2p times varying from message to message, ranks
competing for cores (more workers than cores), and stage imbalance, since the simulator gives
every rank the mean cost while the last stage also runs the head and loss.

Part 2, peer: meshspeed 1F1B and interleaved (vpp 2) against torch.distributed.pipelining's
Schedule1F1B and ScheduleInterleaved1F1B running the very same stage modules. Both losses of
the first step are printed and must agree. Then the pair runs interleaved step by step (order
reversed every other step: benchmarks.harness.interleaved_rounds), --steps timed steps each per
round after warmup; a step's time is the slowest rank's; reported: median over rounds and the
ratio torch / meshspeed (> 1: meshspeed faster) as the median of per-round ratios, with their
range.

    python -m benchmarks.pipeline [--pp 2] [--microbatches 8] [--layers 8] [--dim 256]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import torch
from torch import nn

from benchmarks import harness
from meshspeed import comm
from meshspeed.models import cross_entropy_loss, get_preset, recipe_for
from meshspeed.parallel.pipeline import Costs, closed_form, simulate
from meshspeed.parallel.pipeline.runtime import PipelineRuntime
from meshspeed.parallel.pipeline.stage import build_stages
from meshspeed.parallel.pipeline.trace import compare, measured_result

SCHEDULES = [
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved", 2),
    ("interleaved-extra-warmup", 2),
    ("zero-bubble", 1),
]


def model_config(args):
    return get_preset(
        "tiny",
        n_layers=args.layers,
        dim=args.dim,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=256,
        max_seq_len=args.seq_len,
    )


def batch(args, step: int):
    g = torch.Generator().manual_seed(1000 + step)
    t = torch.randint(0, 256, (args.microbatches * args.micro, args.seq_len + 1), generator=g)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def micro_batches(x, y, args):
    return [
        (x[i * args.micro : (i + 1) * args.micro], y[i * args.micro : (i + 1) * args.micro])
        for i in range(args.microbatches)
    ]


def meshspeed_runner(ctx, mesh, name: str, vpp: int, args, trace: bool = False):
    stages = build_stages(recipe_for(model_config(args)), mesh, vpp=vpp, seed=0)
    rt = PipelineRuntime(
        stages, mesh, name, args.microbatches, micro_batch_size=args.micro, seq_len=args.seq_len, trace=trace
    )

    def step(x, y):
        stages.model.zero_grad(set_to_none=True)
        return rt.train_step(micro_batches(x, y, args)).item() / args.microbatches

    return step, rt


# ------------------------------------------------------------------------------ the peer
class TorchStage(nn.Module):
    """A meshspeed StageChunk as the nn.Module torch.distributed.pipelining expects."""

    def __init__(self, chunk, positions):
        super().__init__()
        self.chunk = chunk
        self.inner = chunk.model  # registers the stage model's parameters
        self.register_buffer("positions", positions, persistent=False)

    def forward(self, x):
        return self.chunk(x, self.positions)


def torch_runner(ctx, mesh, vpp: int, args):
    # The peer being compared: torch's own pipelining runtime (this benchmark may import it;
    # meshspeed itself speaks only through meshspeed.comm).
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    stages = build_stages(recipe_for(model_config(args)), mesh, vpp=vpp, seed=0)
    pp, rank = mesh.dims.pp, mesh.coords["pp"]
    positions = torch.arange(args.seq_len)
    dim = stages.model.config.dim
    act = torch.empty(args.micro, args.seq_len, dim, requires_grad=True)  # stage inputs need gradients
    tok = torch.empty(args.micro, args.seq_len, dtype=torch.int64)
    logits = torch.empty(args.micro, args.seq_len, stages.model.config.vocab_size)
    pstages = []
    for c, chunk in enumerate(stages.chunks):
        s = c * pp + rank
        pstages.append(
            PipelineStage(
                TorchStage(chunk, positions),
                s,
                pp * vpp,
                torch.device("cpu"),
                input_args=(tok if chunk.is_first else act,),
                output_args=(logits if chunk.is_last else act,),
                group=mesh["pp"].pg,
            )
        )

    def loss_fn(out, target):
        return cross_entropy_loss(out, target)

    if vpp == 1:
        sched = Schedule1F1B(pstages[0], args.microbatches, loss_fn=loss_fn)
    else:
        sched = ScheduleInterleaved1F1B(pstages, args.microbatches, loss_fn=loss_fn)
    first = any(c.is_first for c in stages.chunks)
    last = any(c.is_last for c in stages.chunks)

    def step(x, y):
        stages.model.zero_grad(set_to_none=True)
        losses: list = []
        kwargs = {"target": y, "losses": losses} if last else {}
        sched.step(*((x,) if first else ()), **kwargs)
        total = torch.tensor(
            [sum(float(v.detach()) for v in losses) / args.microbatches if last else 0.0], dtype=torch.float64
        )
        return comm.broadcast(total, mesh["pp"], src=pp - 1).item()

    return step


# ------------------------------------------------------------------------------ worker
def bubble_part(ctx, mesh, args, log) -> list[dict]:
    rows = []
    for name, vpp in SCHEDULES:
        if args.layers % (args.pp * vpp):
            log(f"  {name}: skipped ({args.layers} layers do not split into pp*vpp = {args.pp * vpp})")
            continue
        step, rt = meshspeed_runner(ctx, mesh, name, vpp, args, trace=True)
        for w in range(args.warmup):
            step(*batch(args, w))
        results = []
        for s in range(args.steps):
            step(*batch(args, s))
            times = rt.gathered_trace()
            results.append(
                measured_result(name, rt.schedule, times, rt.pp, rt.vpp, rt.microbatches, rt.split)
            )
        results.sort(key=lambda r: r.makespan)
        med = results[len(results) // 2]
        sim = compare(med)
        if args.png and ctx.rank == 0:
            from meshspeed.parallel.pipeline.trace import write_trace

            write_trace(
                os.path.join(args.png, name), med, step=-1
            )  # pp_trace.json + measured / simulated PNGs
        c = med.costs
        sim0 = simulate(med.schedule, args.pp, vpp, Costs(c.f, c.b, c.w, 0.0), split=med.split)
        unit = closed_form(name, args.pp, vpp, args.microbatches, Costs())
        rows.append(
            {
                "schedule": name,
                "vpp": vpp,
                "makespan_ms": med.makespan * 1e3,
                "sim_makespan_ms": float(sim.makespan) * 1e3,
                "bubble": float(med.bubble),
                "sim_bubble": float(sim.bubble),
                "sim_bubble_no_p2p": float(sim0.bubble),
                "unit_bubble": float(unit[0]) if unit else None,
                "costs_ms": {k: getattr(med.costs, k) * 1e3 for k in ("f", "b", "w", "p2p")},
                "busy_ms": [b * 1e3 for b in med.busy],
            }
        )
        log(f"  {name}: measured bubble {float(med.bubble):.3f}, simulated {float(sim.bubble):.3f}")
        del rt, step
        gc.collect()
    return rows


def peer_part(ctx, mesh, args, log) -> list[dict]:
    rows = []
    for label, vpp in (("1f1b", 1), ("interleaved", 2)):
        if args.layers % (args.pp * vpp) or (vpp > 1 and args.microbatches % args.pp):
            log(f"  {label}: skipped (layers or microbatches do not fit pp={args.pp}, vpp={vpp})")
            continue
        ours, _ = meshspeed_runner(ctx, mesh, label, vpp, args)
        try:
            theirs = torch_runner(ctx, mesh, vpp, args)
        except Exception as e:  # report it and go on with the other pair
            log(f"  {label}: torch.distributed.pipelining failed: {type(e).__name__}: {e}")
            continue
        x, y = batch(args, 0)
        l_ours, l_theirs = ours(x, y), theirs(x, y)
        agree = harness.agree([l_ours], [l_theirs], harness.RTOL["float32"])
        log(
            f"  {label}: first-step loss meshspeed {l_ours:.6f} torch {l_theirs:.6f} "
            f"({'agree' if agree else 'MISMATCH'})"
        )
        for w in range(args.warmup):
            ours(*batch(args, w))
            theirs(*batch(args, w))
        sides = {"meshspeed": ours, "torch": theirs}
        rounds = harness.interleaved_rounds(ctx, sides, lambda s: batch(args, s), args.rounds, args.steps)
        ratio, lo, hi = harness.ratio(rounds["meshspeed"], rounds["torch"])
        rows.append(
            {
                "schedule": label,
                "vpp": vpp,
                "loss_meshspeed": l_ours,
                "loss_torch": l_theirs,
                "agree": agree,
                "meshspeed_ms": statistics.median(rounds["meshspeed"]),
                "torch_ms": statistics.median(rounds["torch"]),
                "ratio": ratio,
                "ratio_range": [lo, hi],
            }
        )
        gc.collect()
    return rows


def worker(args_dict: dict, result: str) -> None:
    args = argparse.Namespace(**args_dict)
    torch.set_num_threads(1)
    ctx = comm.init()
    log = (lambda s: print(s, flush=True)) if ctx.rank == 0 else (lambda s: None)
    try:
        mesh = comm.ParallelDims(pp=args.pp).build(ctx)
        out = {}
        if "bubble" in args.parts:
            log("[bubble] measured timelines vs the simulator ...")
            out["bubble"] = bubble_part(ctx, mesh, args, log)
        if "peer" in args.parts:
            log("[peer] meshspeed vs torch.distributed.pipelining ...")
            out["peer"] = peer_part(ctx, mesh, args, log)
        if ctx.rank == 0:
            harness.emit(result, out)
    finally:
        ctx.close()


# ------------------------------------------------------------------------------ report
def report(res: dict, args) -> None:
    if res.get("bubble"):
        print(
            f"\nbubble: pp={args.pp} m={args.microbatches}, {args.layers} layers of dim {args.dim}, "
            f"micro {args.micro} x "
            f"seq {args.seq_len}; median-makespan step of {args.steps}"
        )
        head = (
            "schedule",
            "vpp",
            "F/B/W ms (rank share)",
            "p2p ms",
            "makespan ms",
            "sim ms",
            "bubble",
            "sim bubble",
            "sim, p2p 0",
            "unit-cost",
        )
        rows = []
        for r in res["bubble"]:
            c = r["costs_ms"]
            rows.append(
                (
                    r["schedule"],
                    str(r["vpp"]),
                    f"{c['f']:.1f}/{c['b']:.1f}/{c['w']:.1f}",
                    f"{c['p2p']:.2f}",
                    f"{r['makespan_ms']:.1f}",
                    f"{r['sim_makespan_ms']:.1f}",
                    f"{r['bubble']:.3f}",
                    f"{r['sim_bubble']:.3f}",
                    f"{r['sim_bubble_no_p2p']:.3f}",
                    f"{r['unit_bubble']:.3f}" if r["unit_bubble"] is not None else "-",
                )
            )
        _table(head, rows)
        print(
            "sim = the same schedule simulated with the measured mean F/B/W and p2p (median delivery time "
            "of the messages a rank waited for); sim, p2p 0 = compute costs only; unit-cost = closed form, "
            "f=b=w, p2p 0"
        )
    if res.get("peer"):
        print(
            f"\nvs torch.distributed.pipelining (forward+backward of {args.microbatches} micro-batches; "
            "ratio = torch / "
            "meshspeed, > 1: meshspeed faster)"
        )
        head = ("schedule", "vpp", "loss check", "meshspeed ms", "torch ms", "ratio", "range")
        rows = [
            (
                r["schedule"],
                str(r["vpp"]),
                "agree" if r["agree"] else "MISMATCH",
                f"{r['meshspeed_ms']:.1f}",
                f"{r['torch_ms']:.1f}",
                f"{r['ratio']:.2f}x",
                f"{r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f}",
            )
            for r in res["peer"]
        ]
        _table(head, rows)


def _table(head, rows) -> None:
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    for row in [head] + rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=int, default=2, help="pipeline ranks = worker processes (default 2)")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--micro", type=int, default=4, help="rows per micro-batch")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--steps", type=int, default=5, help="timed steps per schedule (bubble) / per round (peer)"
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--parts", default="bubble,peer")
    p.add_argument("--json", help="write the results here")
    p.add_argument(
        "--png",
        metavar="DIR",
        help="write each schedule's measured and simulated timeline to DIR/<schedule>/",
    )
    args = p.parse_args(argv)
    sizes = ("pp", "microbatches", "micro", "seq_len", "layers", "dim", "steps", "rounds")
    harness.require_positive(p, args, *sizes)
    if args.warmup < 0:
        p.error(f"--warmup {args.warmup}: must be 0 or more")
    args.parts = args.parts.split(",")
    if not args.parts or set(args.parts) - {"bubble", "peer"}:
        p.error(f"--parts {','.join(args.parts)}: choose bubble, peer or bubble,peer")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    print(f"meshspeed pipeline benchmark, torch {torch.__version__}: {args.pp} gloo ranks", flush=True)
    res = harness.spawn_collect(worker, args.pp, vars(args), name="pipeline benchmark")
    report(res, args)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    if args.json:
        harness.write_json(args.json, "results", args, **res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
