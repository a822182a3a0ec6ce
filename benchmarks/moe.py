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

Hot experts brought to the data (moe.replicate_hot): the same ep layer with a router whose
choices are drawn from a Zipf(--zipf) law over the experts (fixed per rank, so every row sees
the same routing; the combine weights still come from the gate), without copies and with K =
--hot. Printed: max/mean rows computed per rank (counted on the experts' forward, copies
included), token all-to-all bytes over all ranks (dispatch and combine, both directions),
expert weight bytes moved (the copies out and their gradients back), the step's time (median
and range over --steps) and whether the outputs agree.

Pipeline rows (--pp-ep E, 0 = skip): a second job of 2 × E ranks, pp 2 × dp E with ep E, a
tiny MoE model (--pp-layers, --pp-dim) through 1F1B, DualPipeV, and DualPipeV with the
forward-backward overlap (PipelineRuntime overlap=True): step time (median, range), the measured
bubble (the recorded timeline's idle share, pipeline/trace.py), the time blocked in the MoE
all-to-alls (summed over the step's layers, mean over ranks) and the share of it the overlap
hid against DualPipeV without it.

    python benchmarks/moe.py [--ep 4] [--experts 8] [--k 2] [--shared 2] [--dim 256] [--hidden 512]
                             [--tokens 1024] [--steps 3] [--zipf 1.2] [--hot 4] [--pp-ep 2]
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
from benchmarks import comm_choices, moe_pipeline
from meshspeed import comm
from meshspeed.models.config import ModelConfig
from meshspeed.models.moe import MoE
from meshspeed.parallel.expert import ExpertParallelMoE, expert_params
from meshspeed.parallel.expert_replicate import ratio


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
    comm.all_to_all = C.all_to_all  # the layer's posted exchanges call it by this name
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
    res: dict = {"ep": ctx.world_size, "args": vars(args), "time": {}, "bytes": {}, "algos": {}}
    for name, layer in layers.items():
        res["algos"][name] = comm_choices.used(ctx, lambda: (layer(x) * probe).sum().backward())
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
    res["hot"] = hot_experts(ctx, args, base, x, probe, counter)
    if ctx.rank == 0:
        res["grouped"] = grouped_vs_loop(base, x.detach(), args.steps)
    comm.barrier(ctx.world)  # every rank leaves the job together (none tears down mid-way)
    if ctx.rank == 0:
        with open(out_path, "w") as f:
            json.dump(res, f)


class ZipfRouter(torch.nn.Module):
    """The layer's router with its top-k choices replaced by a fixed Zipf draw per token (this
    rank's seed): skewed routing on demand. Combine weights: the gate's softmax at those experts,
    renormalised, so the router still gets gradients."""

    def __init__(self, router, n_tokens: int, n_experts: int, k: int, s: float, seed: int):
        super().__init__()
        self.gate, self.top_k = router.gate, k
        law = torch.tensor([1.0 / (e + 1) ** s for e in range(n_experts)]).repeat(n_tokens, 1)
        self.experts = torch.multinomial(law, k, generator=torch.Generator().manual_seed(seed))

    def forward(self, x):
        logits = self.gate(x).float()
        top = logits.softmax(dim=-1).gather(1, self.experts)
        return top / top.sum(dim=1, keepdim=True), self.experts, logits


def hot_experts(ctx, args, base, x, probe, counter) -> dict:
    """Zipf-routed ep layer without copies and with moe.replicate_hot = args.hot."""
    out, outputs = {}, []
    for k in (0, args.hot):
        layer = ExpertParallelMoE(copy.deepcopy(base), ctx.world, "alltoall")
        layer.router = ZipfRouter(layer.router, args.tokens, args.experts, args.k, args.zipf, 100 + ctx.rank)
        layer.replicate_hot = k
        rows = [0]  # rows this rank's experts (and copies) computed in the step
        layer.experts.register_forward_hook(lambda m, a, o: rows.__setitem__(0, rows[0] + a[0].shape[0]))
        times = []
        for i in range(args.steps + 1):
            layer.zero_grad(set_to_none=True)
            x.grad, rows[0] = None, 0
            comm.barrier(ctx.world)
            counter.n = 0
            t0 = time.perf_counter()
            y = layer(x)
            (y * probe).sum().backward()
            if i:
                times.append(step_max(ctx, time.perf_counter() - t0))
        sent = comm.all_reduce(torch.tensor([float(counter.n)], dtype=torch.float64), ctx.world, "sum")
        per_rank = comm.all_gather(torch.tensor([rows[0]]), ctx.world, 0).tolist()
        rep = layer.last_replicas
        out[k] = {
            "time": [statistics.median(times), min(times), max(times)],
            "rows": per_rank,
            "max_mean": ratio(per_rank),
            "a2a_bytes": sent.item(),
            "weight_bytes": 2 * rep.weight_bytes if rep else 0,  # copies out, gradients back
            "copies": len(rep.entries) if rep else 0,
            "plan_max_mean": list(rep.imbalance) if rep else None,
        }
        outputs.append(y.detach())
    diff = (outputs[0] - outputs[1]).abs().max()
    out["max_abs_diff"] = comm.all_reduce(diff.view(1).double(), ctx.world, "max").item()
    return out


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
    print("collective algorithms one step ran (rank 0; calls per algorithm):")
    for name, algos in res["algos"].items():
        print(f"  {name:<14} {comm_choices.describe(algos)}")
    report_hot(res)


def report_hot(res: dict) -> None:
    a, h = res["args"], res["hot"]
    print(
        f"hot experts to the data, Zipf({a['zipf']}) routing over {a['experts']} experts, top {a['k']}, "
        f"ep={res['ep']}, median [min-max] of {a['steps']} steps (fwd+bwd)"
    )
    head = f"{'layout':<20}{'step s':>24}{'max/mean rows':>15}"
    print(f"{head}{'token a2a MB, all ranks':>25}{'weights MB moved':>18}")
    for k in (0, a["hot"]):
        r, name = h[str(k)], "ep" if not k else f"ep replicate_hot {k}"
        t = f"{r['time'][0]:.4f} [{r['time'][1]:.4f}-{r['time'][2]:.4f}]"
        # the counter saw the weights' exchanges too (all to other ranks): tokens are the rest
        mb = f"{(r['a2a_bytes'] - r['weight_bytes']) / 1e6:>25.3f}{r['weight_bytes'] / 1e6:>18.3f}"
        print(f"{name:<20}{t:>24}{r['max_mean']:>15.3f}{mb}")
    hot = h[str(a["hot"])]
    print(
        f"rows per rank: {h['0']['rows']} without copies, {hot['rows']} with {hot['copies']} copies "
        f"(the plan's max/mean {hot['plan_max_mean'][0]:.3f} -> {hot['plan_max_mean'][1]:.3f}); "
        f"outputs differ by at most {h['max_abs_diff']:.1e}"
    )


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
    parser.add_argument("--zipf", type=float, default=1.2, help="Zipf exponent of the hot-expert rows")
    parser.add_argument("--hot", type=int, default=4, help="moe.replicate_hot K of the hot-expert rows")
    moe_pipeline.add_arguments(parser)
    args = parser.parse_args()
    for label, value in comm_choices.param_sets():  # a saved bench comm file: it, then the defaults
        print(f"=== {label} ===", flush=True)
        with tempfile.TemporaryDirectory() as tmp, comm_choices.link_params(value):
            out = os.path.join(tmp, "res.json")
            rc = comm.spawn(worker, args.ep, (args, out))
            if rc:
                sys.exit(rc)
            with open(out) as f:
                report(json.load(f))
    if args.pp_ep:
        moe_pipeline.run(args)


if __name__ == "__main__":
    main()
