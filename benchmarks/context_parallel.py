"""Context parallelism on CPU gloo workers: attention forward+backward time per rank, the share of
ring communication hidden behind compute, and activation bytes per rank.

Spawns --cp local workers (one torch thread each). For one global sequence of --seq tokens:

- single: rank 0 alone runs the model's single-device attention core (torch SDPA, causal) on
  the whole sequence: torch's own equivalent and the per-rank time cp should divide.
- ulysses / ring / hybrid (cp_ulysses 2, when cp ≥ 4 and even): every rank runs its shard.
  A step's time is the slowest rank's; the median of --steps after one warmup is printed, with
  single / impl (> 1: faster per step than one device doing the whole sequence).
- ring hidden: 1 − (time blocked per ring shift during forward+backward, slowest rank) /
  (time of one such shift made with no compute around it). 100%: the transfers cost nothing;
  the blocked time also holds waiting for a slower peer, so this is a lower bound.
- activation bytes: bytes of the tensors autograd saves in one forward of the whole tiny model
  (meshspeed.memory.count_saved: saved-tensor hooks, each storage counted once, parameters and
  buffers left out), single device vs each cp rank: falls as 1/cp.
- CUDA: torch's own context_parallel only runs on CUDA; without a GPU it is reported as not run.

    python -m benchmarks.context_parallel [--cp 2] [--seq 2048] [--long]  (--long: 8192 tokens)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks import harness
from meshspeed import comm
from meshspeed.memory import count_saved
from meshspeed.models import build_model, get_preset
from meshspeed.models.llama import attention_core
from meshspeed.parallel.context import (
    apply_context_parallel,
    context_parallel,
    kv_replication,
    shard_sequence,
)
from meshspeed.parallel.context_comm import RingStats, RingStep


def rnd(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def fwd_bwd(core, q, k, v) -> float:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    t0 = time.perf_counter()
    core(q, k, v).sum().backward()
    return time.perf_counter() - t0


def saved_bytes(model, fn) -> int:
    """Activation bytes autograd keeps for backward after fn() (a forward of model)."""
    with count_saved(model) as c:
        out = fn()
    del out
    return c.bytes


def worker(args, out: str) -> None:
    torch.set_num_threads(1)
    ctx = comm.init("gloo", timeout_s=600)
    cp, seq, h, g, d = ctx.world_size, args.seq, args.heads, args.kv_heads, args.head_dim
    q, k, v = rnd(1, 1, seq, h, d), rnd(2, 1, seq, g, d), rnd(3, 1, seq, g, d)
    mesh = comm.ParallelDims(cp=cp).build(ctx)
    res: dict = {"cp": cp, "seq": seq, "heads": h, "kv_heads": g, "head_dim": d, "time": {}, "act": {}}

    config = get_preset("tiny", n_heads=h, n_kv_heads=g, dim=h * d, max_seq_len=seq, n_layers=2)
    tokens = torch.randint(0, config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))

    if ctx.rank == 0:
        times = [fwd_bwd(attention_core, q, k, v) for _ in range(args.steps + 1)][1:]
        res["time"]["single"] = statistics.median(times)
        model = build_model(config, seed=0)
        res["act"]["single"] = saved_bytes(model, lambda: model(tokens))
    comm.barrier(ctx.world)

    impls = [("ulysses", 1), ("ring", 1)] + ([("hybrid", 2)] if cp >= 4 and cp % 2 == 0 else [])
    for impl, u in impls:
        if ctx.rank == 0:
            print(f"  {impl}: {args.steps} steps at {seq} tokens ...", flush=True)
        core = context_parallel(mesh, impl, cp_ulysses=u)
        pos = core.positions(seq)
        ql, kl, vl = (shard_sequence(t, pos) for t in (q, k, v))
        fwd_bwd(core, ql, kl, vl)  # warmup (and block plan)
        times, waits = [], []
        for _ in range(args.steps):
            comm.barrier(ctx.world)
            core.stats = RingStats()
            times.append(harness.rank_max(ctx, fwd_bwd(core, ql, kl, vl)))
            waits.append(core.stats.wait_s / max(core.stats.transfers, 1))
        res["time"][impl] = statistics.median(times)
        if core.ring.size > 1:
            alone = transfer_alone(ctx, core, ql, kl)
            blocked = harness.rank_max(ctx, statistics.median(waits))
            res.setdefault("hidden", {})[impl] = (max(0.0, 1.0 - blocked / alone), blocked, alone)
        model = build_model(config, seed=0)
        apply_context_parallel(model, core)
        act = saved_bytes(model, lambda: model(shard_sequence(tokens, pos), positions=pos))
        res["act"][impl] = harness.rank_max(ctx, act)
    if ctx.rank == 0:
        harness.emit(out, res)


def transfer_alone(ctx, core, ql, kl) -> float:
    """Seconds of one ring shift of this K/V block with no compute to hide it (slowest rank)."""
    b, s, h, d = ql.shape
    u, g = core.ulysses.size, kl.shape[2]
    heads = g * kv_replication(h, g, u) // u if u > 1 else g  # kv heads after the all-to-all
    kv = torch.zeros(2, b, heads, s * u, d)  # [K|V, batch, kv heads, tokens, hd] as the ring sends
    times = []
    for _ in range(5):
        comm.barrier(ctx.world)
        t0 = time.perf_counter()
        RingStep(kv, core.ring, 1, None).wait()
        times.append(harness.rank_max(ctx, time.perf_counter() - t0))
    return statistics.median(times)


def report(res: dict) -> None:
    t, a = res["time"], res["act"]
    print(
        f"context parallelism, CPU gloo, cp={res['cp']}, seq={res['seq']} tokens, heads {res['heads']} "
        f"(kv {res['kv_heads']}) × {res['head_dim']}, batch 1, one thread per rank"
    )
    print(f"{'impl':<10}{'fwd+bwd s/rank':>16}{'single/impl':>13}{'act MiB/rank':>14}{'single/act':>12}")
    for impl in t:
        print(
            f"{impl:<10}{t[impl]:>16.3f}{t['single'] / t[impl]:>13.2f}{a[impl] / 2**20:>14.2f}"
            f"{a['single'] / a[impl]:>12.2f}"
        )
    for impl, (frac, blocked, alone) in res.get("hidden", {}).items():
        print(
            f"ring communication hidden behind compute ({impl}): {frac:.0%} (blocked {blocked * 1e3:.2f} ms "
            f"per shift vs {alone * 1e3:.2f} ms for a shift alone)"
        )
    if not torch.cuda.is_available():
        print("torch context_parallel (CUDA only): not run, no GPU here")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--long", action="store_true", help="8192 tokens (minutes on 2 cores)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if args.long:
        args.seq = 8192
    harness.require_positive(parser, args, "cp", "seq", "heads", "kv_heads", "head_dim", "steps")
    if args.seq % (2 * args.cp):  # the zigzag layout cuts the sequence in 2 * cp pieces
        parser.error(f"--seq {args.seq}: must be a multiple of 2 × --cp = {2 * args.cp}")
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads}: must be a multiple of --kv-heads {args.kv_heads}")
    if args.head_dim % 2:
        parser.error(f"--head-dim {args.head_dim}: must be even (rotary embedding pairs)")
    report(harness.spawn_collect(worker, args.cp, args, name="context_parallel"))


if __name__ == "__main__":
    main()
