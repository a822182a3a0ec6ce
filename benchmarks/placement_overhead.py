"""Why meshspeed's parameters are plain tensors with a Sharding tag rather than DTensors.

comm/placement.py says DTensor's per-op dispatch would be paid by every matmul. This measures
it: one column-parallel linear forward + backward on 2 gloo ranks, (a) meshspeed's way — the
local weight piece as a plain tensor, the input copied — and (b) DTensor's — a Shard(0) weight
DTensor and a Replicate input DTensor through the same F.linear — side by side in one run,
over a range of sizes. Prints microseconds per step and the ratio.

    python -m benchmarks.placement_overhead [--iters 200]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from benchmarks import harness
from meshspeed import comm
from meshspeed.comm.placement import Shard, local_piece

SIZES = [(64, 64), (256, 256), (1024, 1024)]  # (in, out) features; tokens = 64


def _time(fn, iters: int) -> float:
    for _ in range(5):
        fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e6


def worker(iters: int, out: str) -> None:
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor import Shard as DShard

    ctx = comm.init()
    torch.set_num_threads(1)
    mesh = comm.ParallelDims(tp=ctx.world_size).build(ctx)
    g, dmesh = mesh["tp"], mesh.device_mesh["tp"]
    rows = []
    for fin, fout in SIZES:
        gen = torch.Generator().manual_seed(0)
        full_w = torch.randn(fout, fin, generator=gen)
        x = torch.randn(64, fin, generator=gen)
        w_local = local_piece(full_w, Shard(0), g.rank, g.size).clone().requires_grad_()
        w_dt = DTensor.from_local(w_local.detach().clone(), dmesh, [DShard(0)]).requires_grad_()
        x_dt = DTensor.from_local(x, dmesh, [Replicate()])

        def ours():
            y = F.linear(comm.copy_to(x, g), w_local)  # [tokens, out/tp]
            y.sum().backward()

        def dtensor():
            y = F.linear(x_dt, w_dt)  # DTensor, Shard(-1)
            y.to_local().sum().backward()

        rows.append((fin, fout, _time(ours, iters), _time(dtensor, iters)))
    if ctx.rank == 0:
        harness.emit(out, rows)
    ctx.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args(argv)
    harness.require_positive(ap, args, "iters", "nproc")
    if 64 % args.nproc:  # each size's output features split evenly over the ranks
        ap.error(f"--nproc {args.nproc}: must divide 64, the smallest layer's outputs (1, 2, 4, ..., 64)")
    rows = harness.spawn_collect(worker, args.nproc, args.iters, name="placement_overhead")
    print(f"# column-parallel linear fwd+bwd, 64 tokens, {args.nproc} gloo ranks, 1 thread each")
    print(f"{'in':>6} {'out':>6} {'meshspeed us':>13} {'DTensor us':>11} {'DTensor/meshspeed':>18}")
    for fin, fout, a, b in rows:
        print(f"{fin:>6} {fout:>6} {a:>13.1f} {b:>11.1f} {b / a:>18.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
