"""MoE layer with expert parallelism on CPU gloo workers: step time against experts replicated,
and all-to-all bytes against what the routing predicts.

Spawns --ep workers (one torch thread each); each holds --tokens tokens of width --dim and one
MoE layer of --experts SwiGLU experts (width --hidden, top --k). A step is forward + backward
of sum(out * probe) plus the gradient reduction the layout needs for the expert weights:

- replicated: every rank holds every expert, runs its own tokens through them, and all-reduces
  the expert gradients over all ranks (plain data parallelism).
- ep alltoall / ep allgather: experts split over the ranks (ep = world, so the expert-data-
  parallel group is one rank and expert gradients need no reduction).

Time is the slowest rank's, median of --steps after one warmup. Bytes: rows each rank sends to
other ranks in the step's all-to-alls (dispatch and combine, forward and backward), against
the expectation 4 × tokens × k × (ep−1)/ep × dim × 4 bytes for balanced routing (random
weights route near-uniformly).

Shared-expert overlap: with --shared S shared experts (DeepSeekMoE style), "ep alltoall" runs
them while the dispatch all-to-all is in flight (moe.overlap_shared, the default) and "ep a2a
serial" after it; the time hidden is serial − overlapped, printed beside the shared experts'
own forward + backward time. Grouped matmul (torch._grouped_mm) against the per-expert loop is
timed on one process on the same experts (on CPU here; the CUDA comparison needs a GPU).

    python benchmarks/moe.py [--ep 4] [--experts 8] [--k 2] [--shared 2] [--dim 256] [--hidden 512]
                             [--tokens 1024] [--steps 3]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time

import torch

import meshspeed.comm.collectives as C
from meshspeed import comm
from meshspeed.models.config import ModelConfig
from meshspeed.models.moe import MoE
from meshspeed.parallel.expert import ExpertParallelMoE, expert_params


class A2ABytes:
    """Bytes of rows sent to other members by all_to_all on this rank."""

    def __init__(self):
        self.n = 0

    def wrap(self, fn):
        def counted(tensor, group, in_splits=None, out_splits=None, **kw):
            if in_splits is not None:
                row = tensor[0].numel() * tensor.element_size() if tensor.shape[0] else 0
                self.n += sum(s for j, s in enumerate(in_splits) if j != group.rank) * row
            return fn(tensor, group, in_splits, out_splits, **kw)

        return counted


def step_max(ctx, x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    return comm.all_reduce(t, ctx.world, op="max").item()


def worker(args, out_path: str) -> None:
    torch.set_num_threads(1)
    ctx = comm.init("gloo")
    counter = A2ABytes()
    C.all_to_all = counter.wrap(C.all_to_all)
    config = ModelConfig(
        dim=args.dim, n_layers=1, n_heads=4, vocab_size=32, n_experts=args.experts, top_k=args.k,
        moe_ffn_hidden=args.hidden, moe_impl="loop", n_shared_experts=args.shared,
    )  # fmt: skip
    torch.manual_seed(0)
    base = MoE(config)
    gen = torch.Generator().manual_seed(1 + ctx.rank)
    # the input needs a gradient, as inside a model: the dispatch's backward all-to-all runs too
    x = torch.randn(args.tokens, args.dim, generator=gen).requires_grad_()
    probe = torch.randn(args.tokens, args.dim, generator=gen)
    layers = {
        "replicated": copy.deepcopy(base),
        "ep alltoall": ExpertParallelMoE(copy.deepcopy(base), ctx.world, "alltoall"),
        "ep a2a serial": ExpertParallelMoE(copy.deepcopy(base), ctx.world, "alltoall"),
        "ep allgather": ExpertParallelMoE(copy.deepcopy(base), ctx.world, "allgather"),
    }
    layers["ep a2a serial"].overlap_shared = False
    if base.shared_expert is not None:
        layers["shared alone"] = copy.deepcopy(base.shared_expert)
    res: dict = {"ep": ctx.world_size, "args": vars(args), "time": {}, "bytes": {}}
    for name, layer in layers.items():
        times, sent = [], []
        for i in range(args.steps + 1):
            layer.zero_grad(set_to_none=True)
            x.grad = None
            comm.barrier(ctx.world)
            counter.n = 0
            t0 = time.perf_counter()
            ((layer(x) * probe).sum()).backward()
            if name == "replicated":  # the expert-gradient reduction ep does not need (edp = 1)
                for p in layer.experts.parameters():
                    comm.all_reduce(p.grad, ctx.world, op="avg")
            dt = time.perf_counter() - t0
            if i:
                times.append(step_max(ctx, dt))
                sent.append(counter.n)
        res["time"][name] = statistics.median(times)
        res["bytes"][name] = statistics.median(sent)
        if name not in ("replicated", "shared alone"):
            res["expert_params"] = sum(p.numel() for p in expert_params(layer)[0])
    res["expert_params_replicated"] = sum(p.numel() for p in layers["replicated"].experts.parameters())
    if ctx.rank == 0:
        res["grouped"] = grouped_vs_loop(base, x.detach(), args.steps)
    comm.barrier(ctx.world)  # every rank leaves the job together (none tears down mid-way)
    if ctx.rank == 0:
        with open(out_path, "w") as f:
            json.dump(res, f)


def grouped_vs_loop(base, x: torch.Tensor, steps: int) -> dict:
    """Forward + backward of the routed experts on tokens sorted by expert, one process."""
    with torch.no_grad():
        _, experts, _ = base.router(x)
    flat = experts.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=base.n_experts)
    rows = x[order // experts.shape[1]]
    out = {}
    for impl in ("loop", "grouped_mm"):
        layer = copy.deepcopy(base.experts)
        layer.impl = impl
        times = []
        for i in range(steps + 1):
            t0 = time.perf_counter()
            layer(rows, counts).square().sum().backward()
            if i:
                times.append(time.perf_counter() - t0)
        out[impl] = statistics.median(times)
    return out


def report(res: dict) -> None:
    a, t, b, ep = res["args"], res["time"], res["bytes"], res["ep"]
    print(
        f"MoE layer, CPU gloo, ep={ep}: {a['experts']} experts (SwiGLU {a['dim']}→{a['hidden']}), "
        f"top {a['k']}, {a['tokens']} tokens/rank, one thread per rank, "
        f"median of {a['steps']} steps (fwd+bwd+expert grad sync)"
    )
    print(f"{'layout':<14}{'step s':>10}{'replicated/layout':>19}{'a2a MB sent/rank':>18}")
    for name in t:
        if name != "shared alone":
            print(f"{name:<14}{t[name]:>10.4f}{t['replicated'] / t[name]:>19.2f}{b[name] / 1e6:>18.3f}")
    expect = 4 * a["tokens"] * a["k"] * (ep - 1) / ep * a["dim"] * 4
    print(
        f"all-to-all bytes, ep alltoall: {b['ep alltoall'] / 1e6:.3f} MB measured vs {expect / 1e6:.3f} MB "
        f"expected for balanced routing (ratio {b['ep alltoall'] / expect:.2f})"
    )
    print(
        f"expert parameters per rank: {res['expert_params']} with ep vs {res['expert_params_replicated']} "
        f"replicated ({res['expert_params_replicated'] / res['expert_params']:.1f}x fewer)"
    )
    if "shared alone" in t:
        hidden = t["ep a2a serial"] - t["ep alltoall"]
        print(
            f"shared-expert overlap ({a['shared']} shared): serial {t['ep a2a serial']:.4f} s, overlapped "
            f"{t['ep alltoall']:.4f} s: {hidden * 1e3:+.1f} ms hidden per step; the shared experts alone "
            f"take {t['shared alone'] * 1e3:.1f} ms fwd+bwd"
        )
    g = res["grouped"]
    print(
        f"routed experts fwd+bwd on one process, CPU float32: loop {g['loop'] * 1e3:.1f} ms, "
        f"torch._grouped_mm {g['grouped_mm'] * 1e3:.1f} ms (loop/grouped {g['loop'] / g['grouped_mm']:.2f}x)"
    )
    if not torch.cuda.is_available():
        print("grouped matmul vs loop on CUDA (bf16, sm90+): not run, no GPU here")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ep", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument(
        "--shared", type=int, default=2, help="shared experts (0: none, no overlap to measure)"
    )
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "res.json")
        rc = comm.spawn(worker, args.ep, (args, out))
        if rc:
            sys.exit(rc)
        with open(out) as f:
            report(json.load(f))


if __name__ == "__main__":
    main()
