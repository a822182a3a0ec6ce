"""Tensor-parallel overlap on CPU gloo workers: step time of tp + sequence parallelism with and
without `tp_overlap`, and the share of the all-gather / reduce-scatter time hidden.

Spawns --tp local workers (one torch thread each), each holding its tp piece of a small Llama
(--dim, --layers, --seq tokens × --batch). A step is forward + backward of the training loss;
its time is the slowest rank's; the modes run interleaved step by step (harness.interleaved_rounds),
so a slow spell of the shared machine hits them alike, and mode/plain is read per round.

- plain: SP as without overlap (each all-gather / reduce-scatter blocks before / after its matmul).
- overlap K: tp_overlap with K chunks per rank's sequence block (auto: the cost model's K per
  layer and shape; where it is 1 nothing can be hidden and the layer runs the plain path, so
  auto never loses to plain by more than the noise).
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
from benchmarks import comm_choices
from benchmarks.harness import emit, interleaved_rounds, rank_max, ratio, spawn_collect
from meshspeed import comm
from meshspeed.comm import group as group_mod
from meshspeed.models import build_model, get_preset, recipe_for
from meshspeed.parallel.tensor import model_loss, parallelize, set_tp_overlap


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
    modes = {"plain": None, **{f"overlap K={k}": k for k in args.chunks}, "overlap auto": None}
    waits: dict[str, list[float]] = {m: [] for m in modes}
    losses: dict[str, float] = {}

    def side(name: str, k):
        def step(x, y):
            set_tp_overlap(model, name != "plain", k)  # attributes only: switching costs nothing
            model.zero_grad(set_to_none=True)
            blocked.seconds = 0.0
            loss = model_loss(model, x, y, aux=False)
            loss.backward()
            waits[name].append(blocked.seconds)
            losses[name] = loss.item()

        return step

    sides = {name: side(name, k) for name, k in modes.items()}
    for run in sides.values():  # warm-up; auto works out and records its K per layer and shape
        run(tokens, targets)
    for w in waits.values():
        w.clear()
    algos = {n: comm_choices.used(ctx, lambda run=run: run(tokens, targets)) for n, run in sides.items()}
    for w in waits.values():
        w.clear()
    times = interleaved_rounds(ctx, sides, lambda i: (tokens, targets), args.rounds, args.steps)
    auto = sorted(
        {
            f"{type(m).__name__} x{list(shape)}: K={k}"
            for m in model.modules()
            for (shape, _), k in getattr(m, "tp_overlap_auto", {}).items()
        }
    )
    res = {
        "tp": ctx.world_size,
        "args": vars(args),
        "time_ms": times,
        "blocked_s": {m: rank_max(ctx, statistics.median(w)) for m, w in waits.items()},
        "auto": auto,
        "algos": algos,
        "loss_spread": max(losses.values()) - min(losses.values()),
    }
    if ctx.rank == 0:
        emit(out, res)


def report(res: dict) -> None:
    a, t, b = res["args"], res["time_ms"], res["blocked_s"]
    print(
        f"tp overlap, CPU gloo, tp={res['tp']} + sequence parallel, Llama dim {a['dim']} × {a['layers']} "
        f"layers, batch {a['batch']} × seq {a['seq']}, one thread per rank; modes interleaved step by "
        f"step, {a['rounds']} rounds × {a['steps']} steps, median step per round"
    )
    print(f"{'mode':<16}{'step ms':>10}{'mode/plain':>12}{'(range)':>14}{'comm blocked s':>16}{'hidden':>9}")
    for mode in t:
        med, lo, hi = ratio(t["plain"], t[mode])
        hidden = 1.0 - b[mode] / b["plain"] if b["plain"] > 0 else 0.0
        print(
            f"{mode:<16}{statistics.median(t[mode]):>10.1f}{med:>12.2f}{f'{lo:.2f}-{hi:.2f}':>14}"
            f"{b[mode]:>16.3f}{'' if mode == 'plain' else f'{hidden:.0%}':>9}"
        )
    print("auto's choice per layer (the cost model's K; K=1 runs the plain path): " + "; ".join(res["auto"]))
    print(f"loss spread across modes: {res['loss_spread']:.2e} (exact up to summation order)")
    print("collective algorithms one step ran (rank 0; calls per algorithm):")
    for mode, algos in res["algos"].items():
        print(f"  {mode:<16} {comm_choices.describe(algos)}")
    if not torch.cuda.is_available():
        print("torch async tensor parallelism (CUDA symmetric memory): not run, no GPU here")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="steps per round, every mode")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunks", type=int, nargs="*", default=[2, 4])
    args = parser.parse_args()
    for label, value in comm_choices.param_sets():  # a saved bench comm file: it, then the defaults
        print(f"=== {label} ===", flush=True)
        with comm_choices.link_params(value):
            report(spawn_collect(worker, args.tp, args, name="tp_overlap"))


if __name__ == "__main__":
    main()
