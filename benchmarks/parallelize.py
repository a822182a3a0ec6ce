"""`meshspeed.parallelize` on your own `transformers` Llama against torch's DDP and FSDP2 on the same
object, one run.

Spawns N local gloo workers (dp = N). Every side trains the same LlamaForCausalLM (the same
seeded weights, float32) on the same global batch with its own `labels=` loss and AdamW (lr
3e-4, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on every parameter on both sides: torch's
AdamW decays all of a param group, and parallelize does as torch does):

  DDP              DistributedDataParallel(model) + torch.optim.AdamW(fused)
  FSDP2            fully_shard(each decoder layer), then fully_shard(model) (ZeRO-3's schedule)
                   + torch.optim.AdamW
  meshspeed z1     meshspeed.parallelize(model, dims, zero=1)
  meshspeed z3     meshspeed.parallelize(model, dims, zero=3)
  meshspeed z1 +   zero=1 with chunked_loss=True (the loss without the full logits)
    chunked

The first two steps' losses of every side are compared with DDP's (float32, rel 1e-5) before
anything is timed; a mismatch is flagged. Timing: after `--warmup` untimed steps, the sides run
interleaved step by step (A B C ... C B A), `--steps` per round; a step's time is the slowest
rank's, a round's value its median, the reported value the median over rounds, and `x DDP` the
median of per-round ratios side / DDP (< 1: faster than DDP). Peak bytes: one more step of each
side counted by torch.profiler's memory events (meshspeed.memory.cpu_peak_bytes, the CPU), the
largest rank's: what the step allocates and holds at once above what was live before it.

    python -m benchmarks.parallelize [--nproc 2] [--layers 4] [--json rows.json]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks import harness, peers
from meshspeed import comm

DEFAULTS = dict(
    nproc=2, layers=4, dim=256, vocab=4096, batch=8, seq_len=128, steps=4, rounds=3, warmup=1, seed=0
)
SIDES = ("ddp", "fsdp2", "ms_z1", "ms_z3", "ms_z1_chunked")
LABELS = {
    "ddp": "DDP",
    "fsdp2": "FSDP2 fully_shard",
    "ms_z1": "meshspeed zero=1",
    "ms_z3": "meshspeed zero=3",
    "ms_z1_chunked": "meshspeed z1 + chunked",
}


def _model(args):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.dim,
        intermediate_size=args.dim * 8 // 3 // 8 * 8,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.dim // 64),
        num_key_value_heads=max(1, args.dim // 128),
        max_position_embeddings=args.seq_len,
        use_cache=False,
    )
    torch.manual_seed(args.seed)
    return transformers.LlamaForCausalLM(config).float()


def _torch_adamw(model, fused: bool):
    return torch.optim.AdamW(
        model.parameters(), lr=harness.LR, betas=harness.BETAS, eps=harness.EPS, weight_decay=harness.WD,
        **({"fused": True} if fused else {}),
    )  # fmt: skip


def build(key: str, args, mesh):
    """(the step: tokens -> detached loss) of one side."""
    import meshspeed

    model = _model(args)
    if key == "ddp":
        model = peers.ddp(model, mesh.device_mesh.get_group("dp"))
        opt = _torch_adamw(model, fused=True)
    elif key == "fsdp2":
        model = peers.fsdp2(model, mesh.device_mesh["dp"], True, blocks=model.model.layers)
        opt = _torch_adamw(model, fused=False)
    else:
        kw = dict(zero=3 if key == "ms_z3" else 1, chunked_loss=key.endswith("chunked"))
        kw.update(lr=harness.LR, betas=harness.BETAS, eps=harness.EPS, weight_decay=harness.WD)
        model, opt = meshspeed.parallelize(model, mesh, **kw)

    def step(x):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step


def worker(args_dict: dict, out: str) -> None:
    from meshspeed.memory.count import cpu_peak_bytes

    args = argparse.Namespace(**args_dict)
    ctx = comm.init()
    try:
        mesh = comm.ParallelDims(dp=ctx.world_size).build(ctx)
        g = torch.Generator().manual_seed(args.seed + 1)
        rows = args.batch // ctx.world_size
        data = [
            (torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=g)[ctx.rank * rows :][:rows],)
            for _ in range(4)
        ]
        steps, losses = {}, {}
        for key in SIDES:
            if ctx.rank == 0:
                print(f"  {LABELS[key]}: building, {args.warmup} warm-up step(s) ...", flush=True)
            steps[key] = build(key, args, mesh)
            losses[key] = harness.first_losses(steps[key], data, mesh["dp"])
            for i in range(args.warmup):
                steps[key](*data[i % len(data)])
        if ctx.rank == 0:
            print(f"  timing {args.rounds} rounds × {args.steps} steps per side ...", flush=True)
        times = harness.interleaved_rounds(ctx, steps, lambda i: data[i % len(data)], args.rounds, args.steps)
        peak = {}
        for key in SIDES:  # one more step each, counted
            peak[key] = int(harness.rank_max(ctx, cpu_peak_bytes(lambda k=key: steps[k](*data[0]))))
        if ctx.rank == 0:
            harness.emit(out, {"losses": losses, "rounds_ms": times, "peak_bytes": peak})
    finally:
        ctx.close()


def run(**kw) -> list[dict]:
    """Run the comparison (keyword overrides of DEFAULTS); one row per side: benchmark, variant,
    side, step_ms, rounds_ms, x_ddp (median ratio side / DDP) and its range, peak_bytes,
    losses, loss_ok (against DDP's), settings. Exits when the workers fail."""
    args = dict(DEFAULTS, **kw)
    unknown = set(args) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"parallelize.run: unknown settings {sorted(unknown)}; valid: {sorted(DEFAULTS)}")
    if args["batch"] % args["nproc"]:
        raise ValueError(f"batch={args['batch']} must be a multiple of nproc={args['nproc']}")
    res = harness.spawn_collect(worker, args["nproc"], args, name="parallelize benchmark")
    base, rows = res["rounds_ms"]["ddp"], []
    for key in SIDES:
        x, lo, hi = harness.ratio(base, res["rounds_ms"][key])
        rows.append(
            {
                "benchmark": "parallelize",
                "variant": LABELS[key],
                "side": key,
                "step_ms": statistics.median(res["rounds_ms"][key]),
                "rounds_ms": res["rounds_ms"][key],
                "x_ddp": x,
                "x_ddp_range": [lo, hi],
                "peak_bytes": res["peak_bytes"][key],
                "losses": res["losses"][key],
                "loss_ok": harness.agree(res["losses"]["ddp"], res["losses"][key], harness.RTOL["float32"]),
                "settings": args,
            }
        )
    return rows


def report(rows: list[dict]) -> None:
    s = rows[0]["settings"]
    print(
        f"\nyour own transformers Llama ({s['layers']} layers, dim {s['dim']}, vocab {s['vocab']}) float32, "
        f"global batch {s['batch']} x seq {s['seq_len']}, dp {s['nproc']} gloo ranks; "
        f"median of {s['rounds']} rounds x {s['steps']} steps"
    )
    hdr = f"{'side':<24} {'step ms':>9} {'x DDP':>7} {'range':>13} {'step peak MB':>13}  losses (steps 1, 2)"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        lo, hi = r["x_ddp_range"]
        flag = "" if r["loss_ok"] else "  (!) differs from DDP"
        print(
            f"{r['variant']:<24} {r['step_ms']:9.1f} {r['x_ddp']:7.3f} {f'{lo:.2f}-{hi:.2f}':>13} "
            f"{r['peak_bytes'] / 2**20:13.1f}  {r['losses'][0]:.6f} {r['losses'][1]:.6f}{flag}"
        )
    if not all(r["loss_ok"] for r in rows):
        print(harness.mismatch_note("the sides"))


def main(argv=None) -> None:
    p = harness.parser(__doc__)
    for k, v in DEFAULTS.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    harness.require_positive(p, args, *(k for k in DEFAULTS if k not in ("seed", "warmup")))
    if args.batch % args.nproc:
        p.error(f"--batch {args.batch}: must be a multiple of --nproc {args.nproc}")
    heads, kv = max(1, args.dim // 64), max(1, args.dim // 128)
    if args.dim % heads or (args.dim // heads) % 2 or heads % kv:
        p.error(f"--dim {args.dim}: {heads} heads of an even size must divide it; use a multiple of 128")
    try:
        import transformers  # noqa: F401  (the model under test is a transformers Llama)
    except ImportError:
        p.error("needs transformers: pip install -e .[dev]")
    rows = run(**{k: getattr(args, k) for k in DEFAULTS})
    report(rows)
    if args.json:
        harness.write_json(args.json, "parallelize benchmark", args, rows=rows)


if __name__ == "__main__":
    main()
