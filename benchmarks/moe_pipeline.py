"""benchmarks/moe.py's pipeline rows: 1F1B against DualPipeV with and without the forward-backward
overlap, on a tiny MoE model at pp 2 × ep E (2·E CPU gloo ranks, dp = ep = E).

Each variant runs --steps timed steps after one warmup with the same seeded model, stages cut
for its schedule's placement, and the same micro-batches. Per step: the slowest rank's time
(forward + backward + gradient reduction), the measured bubble of the recorded timeline (idle
share of pp × makespan over compute actions, pipeline/trace.py) and the seconds the MoE
layers blocked waiting for their all-to-alls (mean over ranks). The overlap's effect: the
share of DualPipeV's blocked all-to-all time that the overlapped run no longer blocks on.
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.harness import emit, spawn_collect
from meshspeed import comm
from meshspeed.models import get_preset, recipe_for
from meshspeed.parallel.expert import expert_parallel
from meshspeed.parallel.optim import build_data_parallel
from meshspeed.parallel.pipeline.runtime import PipelineRuntime
from meshspeed.parallel.pipeline.schedules import get_schedule
from meshspeed.parallel.pipeline.stage import build_stages
from meshspeed.parallel.pipeline.trace import measured_result

VARIANTS = (("1f1b", False), ("dualpipev", False), ("dualpipev", True))


def add_arguments(parser) -> None:
    parser.add_argument("--pp-ep", type=int, default=2, help="pipeline rows: ep (2·ep ranks); 0 skips them")
    parser.add_argument("--pp-layers", type=int, default=4)
    parser.add_argument("--pp-dim", type=int, default=128)
    parser.add_argument("--pp-seq", type=int, default=64)
    parser.add_argument("--pp-micro", type=int, default=4, help="micro-batches per step (>= 4)")


def worker(args, out: str) -> None:
    torch.set_num_threads(1)
    ctx = comm.init("gloo")
    mesh = comm.ParallelDims(pp=2, dp=args.pp_ep, ep=args.pp_ep).build(ctx)
    cfg = get_preset(
        "tiny-moe", n_layers=args.pp_layers, dim=args.pp_dim, n_heads=4, n_kv_heads=2,
        moe_ffn_hidden=args.pp_dim, aux_loss_coef=0.0, z_loss_coef=0.0,
    )  # fmt: skip
    rows, seq, m = 2, args.pp_seq, args.pp_micro
    gen = torch.Generator().manual_seed(7 + mesh.coords["dp"])
    tokens = torch.randint(0, cfg.vocab_size, (m * rows, seq + 1), generator=gen)
    micro = [(t[:, :-1], t[:, 1:]) for t in tokens.split(rows)]
    res = {}
    for name, overlap in VARIANTS:
        stages = build_stages(
            recipe_for(cfg), mesh, seed=0, placement=get_schedule(name).placement,
            vpp=2 if get_schedule(name).interleaved else 1,
            transform=lambda model: expert_parallel(model, mesh["ep"]),
        )  # fmt: skip
        moes = [mod for mod in stages.model.modules() if hasattr(mod, "a2a_clock")]
        dp, _ = build_data_parallel(stages.model, mesh, dtype=torch.float32)
        rt = PipelineRuntime(
            stages, mesh, name, m, micro_batch_size=rows, seq_len=seq, trace=True, overlap=overlap
        )
        times, bubbles, waits, losses = [], [], [], []
        for i in range(args.steps + 1):
            dp.zero_grad()
            for mod in moes:
                mod.a2a_clock.seconds = 0.0
            comm.barrier(ctx.world)
            t0 = time.perf_counter()
            total = rt.train_step(micro, dp)
            dp.finish_grad_sync()
            dt = time.perf_counter() - t0
            wait = sum(mod.a2a_clock.seconds for mod in moes)
            step = comm.all_reduce(torch.tensor([dt], dtype=torch.float64), ctx.world, "max").item()
            wait = comm.all_reduce(torch.tensor([wait], dtype=torch.float64), ctx.world, "avg").item()
            trace = rt.gathered_trace()
            if i:
                result = measured_result(rt.name, rt.schedule, trace, rt.pp, rt.vpp, m, rt.split)
                times.append(step)
                bubbles.append(float(result.bubble))
                waits.append(wait)
                losses.append(float(total) / m)
        dp.remove_hooks()
        res[f"{name}{' overlap' if overlap else ''}"] = {
            "time": [statistics.median(times), min(times), max(times)],
            "bubble": [statistics.median(bubbles), min(bubbles), max(bubbles)],
            "a2a_wait": [statistics.median(waits), min(waits), max(waits)],
            "pairs": len(rt.last_duets),
            "loss": losses[0],
        }
    if ctx.rank == 0:
        emit(out, res)


def run(args) -> None:
    res = spawn_collect(worker, 2 * args.pp_ep, args, name="moe pipeline rows")
    print(
        f"pipeline, tiny MoE ({args.pp_layers} layers, dim {args.pp_dim}, {args.pp_micro} micro-batches of "
        f"2 × {args.pp_seq}), pp 2 × ep {args.pp_ep} on {2 * args.pp_ep} CPU gloo ranks, "
        f"median [min-max] of {args.steps} steps"
    )
    print(f"{'schedule':<20}{'step s':>24}{'bubble':>20}{'a2a blocked s':>24}{'pairs':>7}{'loss':>10}")
    for name, r in res.items():
        t, b, w = r["time"], r["bubble"], r["a2a_wait"]
        print(
            f"{name:<20}{t[0]:>9.4f} [{t[1]:.4f}-{t[2]:.4f}]{b[0]:>7.3f} [{b[1]:.3f}-{b[2]:.3f}]"
            f"{w[0]:>9.4f} [{w[1]:.4f}-{w[2]:.4f}]{r['pairs']:>7}{r['loss']:>10.5f}"
        )
    plain, over = res["dualpipev"]["a2a_wait"][0], res["dualpipev overlap"]["a2a_wait"][0]
    hidden = (plain - over) / plain if plain > 0 else 0.0
    print(
        f"all-to-all time hidden by the overlap: {hidden:.0%} of DualPipeV's blocked time "
        f"({plain * 1e3:.1f} -> {over * 1e3:.1f} ms per step, median)"
    )
