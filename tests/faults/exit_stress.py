"""Many short jobs through meshspeed's own launcher, each running the paths whose threads and
handles must not outlive their owners (the ring exchange of context parallelism forward and
backward, the all-to-all and a ring all-reduce with asynchronous handles) and then leaving
WITHOUT closing its context, the way the benchmarks do: rank 0 leaves last, after extra work,
as a benchmark writing its results does. A native abort at start-up or exit ("terminate called
without an active exception", SIGABRT) makes a job fail.

    python -m tests.faults.exit_stress --jobs 20 --world 2     (prints one line per job, then a tally)
"""

from __future__ import annotations

import argparse
import sys
import time


def worker(seed: int) -> None:
    import torch

    from meshspeed import comm
    from meshspeed.parallel.context import context_parallel, shard_sequence

    torch.set_num_threads(1)
    ctx = comm.init("gloo", timeout_s=60)
    mesh = comm.ParallelDims(cp=ctx.world_size).build(ctx)
    seq, g = 64 * ctx.world_size, torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, seq, 4, 8, generator=g) for _ in range(3))
    core = context_parallel(mesh, "ring")
    pos = core.positions(seq)
    ql, kl, vl = (shard_sequence(t, pos).detach().requires_grad_() for t in (q, k, v))
    core(ql, kl, vl).sum().backward()  # ring shifts forward and backward, asynchronous
    n = ctx.world_size
    comm.all_to_all(torch.ones(2 * n, 3), ctx.world, [2] * n, [2] * n, async_op=True).wait()
    comm.all_reduce(torch.ones(5), ctx.world, algo="ring", async_op=True).wait()
    if ctx.rank == 0:
        time.sleep(0.2)  # the last to leave, as a benchmark writing its results


def main() -> int:
    from meshspeed import comm

    p = argparse.ArgumentParser()
    p.add_argument("--jobs", type=int, default=20)
    p.add_argument("--world", type=int, default=2)
    args = p.parse_args()
    failed = 0
    for j in range(args.jobs):
        rc = comm.spawn(worker, args.world, (j,))
        failed += rc != 0
        print(f"job {j}: exit {rc}", flush=True)
    print(f"{failed} of {args.jobs} jobs failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
