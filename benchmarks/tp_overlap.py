"""Tensor-parallel overlap on CPU gloo workers: step time of tp + sequence parallelism with and
without `tp_overlap`, and the share of the all-gather / reduce-scatter time hidden.

Spawns --tp local workers (one torch thread each), each holding its tp piece of a small Llama
(--dim, --layers, --seq tokens × --batch). A step is forward + backward of the training loss;
its time is the slowest rank's, the median of --steps after one warmup.

- plain: SP as without overlap (each all-gather / reduce-scatter blocks before / after its matmul).
- overlap K: tp_overlap with K chunks per rank's sequence block (auto: the cost model's K).
- comm blocked: seconds a rank spends inside the all-gathers and reduce-scatters (plain: the
  whole collective; overlap: issuing plus waiting on each chunk's handle), slowest rank.
  hidden = 1 − blocked(overlap) / blocked(plain). The embedding's reduce-scatter cannot overlap
  and is in both, and the blocked time also holds waiting for a slower peer: a lower bound.
- CUDA: torch's async tensor parallelism (symmetric memory, micro-pipeline TP) needs CUDA;
  without a GPU it is reported as not run.

    python -m benchmarks.tp_overlap [--tp 4] [--dim 512] [--seq 256] [--batch 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import meshspeed.comm.collectives as C
from benchmarks.harness import emit, slowest, spawn_collect
from meshspeed import comm
from meshspeed.comm import group as group_mod
from meshspeed.models import build_model, get_preset, recipe_for
from meshspeed.parallel.tensor import ColumnParallelLinear, model_loss, parallelize, set_tp_overlap
from meshspeed.parallel.tp_overlap import default_chunks


class Blocked:
    """Wall time inside all_gather / reduce_scatter calls and Handle.wait, not counted twice
    when a synchronous collective waits on its own handle."""

    def __init__(self):
        self.seconds, self.depth = 0.0, 0

    def wrap(self, fn):
        def timed(*a, **k):
            if self.depth:
                return fn(*a, **k)
            self.depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0
                self.depth -= 1

        return timed


def install(blocked: Blocked) -> None:
    # autograd.py calls C.<op>; tp_overlap.py calls comm.<op>: both bindings are timed.
    for mod in (C, comm):
        for op in ("all_gather", "reduce_scatter"):
            setattr(mod, op, blocked.wrap(getattr(mod, op)))
    group_mod.Handle.wait = blocked.wrap(group_mod.Handle.wait)


def worker(args, out: str) -> None:
    torch.set_num_threads(1)
    ctx = comm.init("gloo", timeout_s=600)
    blocked = Blocked()
    install(blocked)
    config = get_preset(
        "tiny",
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.dim // 64,
        n_kv_heads=args.dim // 64,
        ffn_hidden=3 * args.dim,
        vocab_size=1024,
        max_seq_len=args.seq,
    )
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=gen)
    targets = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=gen)
    mesh = comm.ParallelDims(tp=ctx.world_size).build(ctx)
    model = parallelize(build_model(config, seed=0), mesh, recipe_for(config), sequence_parallel=True)
    col = next(m for m in model.modules() if isinstance(m, ColumnParallelLinear) and m.sequence_parallel)
    tok_bytes = args.batch * args.seq * args.dim * 4
    auto_k = default_chunks(
        mesh["tp"], tok_bytes, 2.0 * args.batch * args.seq * args.dim * col.weight.shape[0]
    )
    res: dict = {"tp": ctx.world_size, "args": vars(args), "time": {}, "blocked": {}, "auto_k": auto_k}
    modes = [("plain", None)] + [(f"overlap K={k}", k) for k in args.chunks] + [("overlap auto", None)]
    losses = {}
    for name, k in modes:
        set_tp_overlap(model, name != "plain", k)
        times, waits = [], []
        for i in range(args.steps + 1):
            model.zero_grad(set_to_none=True)
            comm.barrier(ctx.world)
            blocked.seconds = 0.0
            t0 = time.perf_counter()
            loss = model_loss(model, tokens, targets, aux=False)
            loss.backward()
            dt = time.perf_counter() - t0
            if i:  # the first step warms up
                times.append(slowest(ctx, dt))
                waits.append(slowest(ctx, blocked.seconds))
        losses[name] = loss.item()
        res["time"][name], res["blocked"][name] = statistics.median(times), statistics.median(waits)
    res["loss_spread"] = max(losses.values()) - min(losses.values())
    if ctx.rank == 0:
        emit(out, res)


def report(res: dict) -> None:
    a, t, b = res["args"], res["time"], res["blocked"]
    print(
        f"tp overlap, CPU gloo, tp={res['tp']} + sequence parallel, Llama dim {a['dim']} × {a['layers']} "
        f"layers, batch {a['batch']} × seq {a['seq']}, one thread per rank, median of {a['steps']} steps"
    )
    print(f"{'mode':<16}{'step s':>10}{'plain/mode':>12}{'comm blocked s':>16}{'hidden':>9}")
    for mode in t:
        hidden = 1.0 - b[mode] / b["plain"] if b["plain"] > 0 else 0.0
        print(
            f"{mode:<16}{t[mode]:>10.3f}{t['plain'] / t[mode]:>12.2f}{b[mode]:>16.3f}"
            f"{'' if mode == 'plain' else f'{hidden:.0%}':>9}"
        )
    print(f"cost model's K for the column layers' all-gather: {res['auto_k']}")
    print(f"loss spread across modes: {res['loss_spread']:.2e} (exact up to summation order)")
    if not torch.cuda.is_available():
        print("torch async tensor parallelism (CUDA symmetric memory): not run, no GPU here")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--chunks", type=int, nargs="*", default=[2, 4])
    args = parser.parse_args()
    report(spawn_collect(worker, args.tp, args, name="tp_overlap"))


if __name__ == "__main__":
    main()
