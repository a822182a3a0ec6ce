"""Memory features side by side, in one run: counted bytes per rank and step time.

Spawns --nproc gloo workers (data parallel, one torch thread each). Each builds the trainer
once per feature (the `small` preset at --dim and --layers, float32 unless the row says bf16), trains
--steps steps after one warmup step, and counts on its own rank:
- params: distinct storages behind the model's parameters (flat DP buckets count once; with
  memory.reuse_fp32_param they hold the masters' residuals too); ZeRO-3: the rank's shards plus
  the blocks gathered at the step's peak;
- grads: the data-parallel gradient storage held after the step (DataParallel.grad_bytes);
- optimizer: optimizer state on the parameters' device (fp32 masters + moments; what
  memory.offload_optimizer moves to the host is not counted);
- activations: bytes autograd keeps between forward and backward for one micro-batch, counted
  with saved-tensor hooks (meshspeed.memory.count_saved) around the trainer's own loss;
- plan est.: the run plan's device total for the rank (meshspeed train --dry-run: the same four
  plus its buffers: a ZeRO-3 rank's gathered blocks, offload's buckets in transit, SP gathers).
Rows with an unknown or refused setting print the one-line reason instead. Step time is the
slowest rank's median. ZeRO-3 against FSDP2 (torch's fully_shard, benchmarks/zero3.py) follows.
On CUDA, torch.cuda.max_memory_allocated is printed per row.

    python -m benchmarks.memory [--nproc 2] [--steps 3] [--dim 256] [--layers 8] [--seq 256]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from benchmarks import harness, zero3
from meshspeed import comm
from meshspeed.memory import count_saved

FEATURES = [
    ("baseline", []),
    ("recompute activation", [("memory.recompute", "activation")]),
    ("recompute selective", [("memory.recompute", "selective")]),
    ("recompute full", [("memory.recompute", "full")]),
    ("chunked loss", [("memory.chunked_loss", "true"), ("memory.loss_chunk", "64")]),
    ("swap activations", [("memory.swap_activations", "true")]),
    ("ZeRO-1", [("parallel.zero", "1")]),
    ("ZeRO-2", [("parallel.zero", "2")]),
    ("ZeRO-3", [("parallel.zero", "3")]),
    ("offload optimizer", [("memory.offload_optimizer", "true")]),
    ("baseline bf16", [("train.dtype", "bfloat16")]),
    ("reuse fp32 param (bf16)", [("train.dtype", "bfloat16"), ("memory.reuse_fp32_param", "true")]),
]


def overrides(args, run_dir: str) -> list[tuple[str, str]]:
    return [
        ("model.preset", "small"),
        ("model.dim", str(args.dim)),
        ("model.n_layers", str(args.layers)),
        ("parallel.tp", "1"),  # every rank data parallel: ZeRO shards over all of them
        ("train.seq_len", str(args.seq)),
        ("train.micro_batch_size", "2"),
        ("train.global_batch_size", str(2 * args.nproc)),
        ("train.steps", str(args.steps + 1)),
        ("train.eval_interval", "0"),
        ("train.dtype", "float32"),
        ("run.dir", run_dir),
        ("run.overwrite", "true"),
        ("checkpoint.interval", "0"),
    ]


def measure(trainer, args, ctx) -> dict:
    times = []
    for step in range(args.steps + 1):
        comm.barrier(ctx.world)
        t0 = time.perf_counter()
        trainer.train_step(step)
        dt = time.perf_counter() - t0
        if step:  # the first step warms up
            times.append(harness.rank_max(ctx, dt))
    model = trainer.model
    z3 = getattr(trainer.dp, "zero3", None)
    gen = torch.Generator().manual_seed(ctx.rank)
    x = torch.randint(0, trainer.model_config.vocab_size, (2, args.seq), generator=gen)
    with count_saved(model) as c:
        ce, aux = trainer._loss(x, x)
    activations = c.bytes  # now: backward brings recomputed storages back
    (ce if aux is None else ce + aux).backward()  # free the graph like a step would
    trainer.dp.zero_grad()
    out = {
        # ZeRO-3: its shards plus the blocks gathered at the peak of the step (counted by zero3.py)
        "params": z3.peak_bytes if z3 is not None else harness.storage_bytes(model.parameters()),
        "grads": trainer.dp.grad_bytes(),
        "optimizer": trainer.opt.state_bytes(),
        "activations": activations,
        "time": statistics.median(times),
    }
    if torch.cuda.is_available():
        out["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
    return out


def worker(args, out: str) -> None:
    torch.set_num_threads(1)
    ctx = comm.init("gloo")
    from meshspeed.plan import config
    from meshspeed.plan.run_plan import make_plan
    from meshspeed.train.trainer import Trainer

    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, extra) in enumerate(FEATURES, 1):
            if ctx.rank == 0:  # each row builds a trainer and trains: tens of seconds on 2 cores
                print(f"  [{i}/{len(FEATURES)}] {name} ...", flush=True)
            run_dir = os.path.join(tmp, name.replace(" ", "-"))
            try:
                cfg = config.load(None, overrides(args, run_dir) + extra)
                plan = make_plan(cfg, ctx.world_size)
                trainer = Trainer(cfg, ctx, plan)
            except (comm.ConfigError, ValueError) as e:
                rows[name] = {"error": str(e).splitlines()[0]}
                continue
            rows[name] = measure(trainer, args, ctx)
            est = plan.ranks[ctx.rank]["memory"]
            rows[name]["estimate"] = est["total"]
            del trainer
    if ctx.rank == 0:
        harness.emit(out, rows)


def report(rows: dict, args) -> None:
    print(
        f"memory features, CPU gloo, {args.nproc} data-parallel ranks, `small` preset at dim {args.dim} × "
        f"{args.layers} layers (byte vocabulary: 256), 2 × {args.seq} tokens per micro-batch; bytes counted "
        "on rank 0"
    )
    cols = ("params", "grads", "optimizer", "activations")
    head = f"{'feature':<25}" + "".join(f"{c:>13}" for c in cols)
    print(head + f"{'total':>13}{'vs base':>9}{'plan est.':>13}{'step s':>9}{'time x':>8}")
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:<25}  not run: {r['error']}")
            continue
        base = rows["baseline bf16" if "bf16" in name and name != "baseline bf16" else "baseline"]
        total = sum(r[k] for k in cols)
        btotal = sum(base[k] for k in cols) if "error" not in base else total
        line = f"{name:<25}" + "".join(f"{r[k]:>13,}" for k in cols)
        line += f"{total:>13,}{total / btotal:>9.3f}{r['estimate']:>13,}{r['time']:>9.3f}"
        line += f"{r['time'] / base.get('time', r['time']):>8.2f}"
        if "cuda_max_allocated" in r:
            line += f"  cuda max allocated {r['cuda_max_allocated']:,}"
        print(line)
    if not torch.cuda.is_available():
        print("torch.cuda.max_memory_allocated against the estimator: not run, no GPU here")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--no-zero3", action="store_true", help="skip the ZeRO-3 against FSDP2 part")
    args = parser.parse_args()
    harness.require_positive(parser, args, "nproc", "steps", "dim", "layers", "seq")
    if args.dim % 8 or (args.dim // 8) % 2:  # the small preset's 8 heads, RoPE's even head size
        parser.error(f"--dim {args.dim}: must be a multiple of 16 (8 heads of an even size), e.g. 64 or 256")
    report(harness.spawn_collect(worker, args.nproc, args, name="memory benchmark"), args)
    if not args.no_zero3:
        zero3.main(["--nproc", str(args.nproc)])


if __name__ == "__main__":
    main()
