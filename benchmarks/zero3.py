"""meshspeed ZeRO-3 (`--parallel.zero 3`) vs FSDP2 (`torch.distributed.fsdp.fully_shard`), one run.

Spawns N local gloo workers (dp = N). Both sides train the same model (same seeded weights) on
the same global batch with AdamW (lr 3e-4, betas (0.9, 0.95), weight decay 0.1 on >= 2-D
parameters, no clipping), float32:

  meshspeed  build_data_parallel(zero=3, units="layers"): a flat bucket per block + one for the
             rest, gathered per block with the next one prefetched, freed after forward,
             re-gathered for backward, gradients reduce-scattered (meshspeed/parallel/zero3.py)
  FSDP2      fully_shard(block) for every block, then fully_shard(model)
             (reshard_after_forward=True: the same ZeRO-3 schedule) + torch.optim.AdamW

The two first steps' losses are compared (float32, rel 1e-5) before anything is timed; a
mismatch is flagged. Timing: after `--warmup` untimed steps, the two sides run interleaved step
by step (A B B A ...), `--steps` per round; a step's time is the slowest rank's, a round's value
its median, the reported value the median over rounds, the ratio FSDP2 / meshspeed (> 1:
meshspeed faster) the median of per-round ratios with their range.

Parameter bytes are counted, not estimated: the storage sizes of the parameter tensors a rank
holds (sharded and gathered), deduplicated by storage. Sampled at the same points on both sides
(before and after the forward of every module that holds parameters directly, and before its
backward) during the timed steps; reported: the peak, and what is held between steps. FSDP2's
are read from its parameter objects (sharded data, all-gather outputs, unsharded parameters,
in-flight all-gather buffers: torch internals, read only). meshspeed's exact peak (updated at
every gather) is in the rows as `exact_peak_param_bytes`.

    python -m benchmarks.zero3 [--nproc 2] [--model small] [--layers 4] [--json rows.json]
    from benchmarks import zero3; rows = zero3.run(nproc=2)        # as benchmarks/memory.py does
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

from benchmarks import harness, peers
from meshspeed import comm
from meshspeed.models import cross_entropy_loss, preset_names
from meshspeed.parallel.optim import build_data_parallel

DEFAULTS = dict(
    nproc=2, model="small", layers=4, batch=8, seq_len=64, steps=4, rounds=3, warmup=1, seed=0, verbose=False
)


class Sampler:
    """Peak of count() over the forward pre/post and backward-pre points of every module that
    holds parameters directly (the same points for both sides)."""

    def __init__(self, model, count):
        self.count, self.peak, self.on = count, 0, False
        for m in model.modules():
            if any(True for _ in m.parameters(recurse=False)):
                m.register_forward_pre_hook(lambda *a: self.sample())
                m.register_forward_hook(lambda *a: self.sample())
                m.register_full_backward_pre_hook(lambda *a: self.sample())

    def sample(self) -> None:
        if self.on:
            self.peak = max(self.peak, self.count())


# ------------------------------------------------------------------------------ the two sides
def _model(args):
    return harness.preset_model(
        args.model, args.seq_len, args.seed, **({"n_layers": args.layers} if args.layers else {})
    )


def _step(model, opt):
    """One training step, the same on both sides: loss, backward, optimizer step."""
    return harness.optimizer_step(opt, lambda x, y: cross_entropy_loss(model(x), y))


def build_meshspeed(args, mesh):
    model = _model(args)
    kw = dict(lr=harness.LR, weight_decay=harness.WD, betas=harness.BETAS, eps=harness.EPS)
    dp, opt = build_data_parallel(model, mesh, zero=3, dtype=torch.float32, units="layers", **kw)
    z = dp.zero3
    return _step(model, opt), Sampler(model, z.live_param_bytes), z.live_param_bytes, z, (model, dp, opt)


def build_fsdp2(args, mesh):
    model = peers.fsdp2(_model(args), mesh.device_mesh["dp"], reshard_after_forward=True)
    opt = peers.adamw(model, None)  # torch's default AdamW implementation

    def count() -> int:
        return peers.fsdp2_param_bytes(model)

    return _step(model, opt), Sampler(model, count), count, None, (model, opt)


SIDES = (("meshspeed", "meshspeed zero=3", build_meshspeed), ("peer", "FSDP2 fully_shard", build_fsdp2))


# ------------------------------------------------------------------------------ worker
def worker(args_dict: dict, out: str) -> None:
    args = argparse.Namespace(**args_dict)
    # the sampling hooks on the embedding (whose input needs no gradient) and FSDP2's root output
    # (a view) make torch warn on every step; neither changes what is computed
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    ctx = comm.init()
    try:
        mesh = comm.ParallelDims(dp=ctx.world_size).build(ctx)
        vocab = _model(args).config.vocab_size
        data = harness.token_batches(args.seed, vocab, args.batch, args.seq_len, ctx.rank, ctx.world_size)
        sides = {}
        for key, label, build in SIDES:
            if ctx.rank == 0:
                print(f"  {label}: building, {args.warmup} warm-up step(s) ...", flush=True)
            torch.manual_seed(args.seed)
            step, sampler, count, z, keep = build(args, mesh)
            losses = harness.first_losses(step, data, mesh["dp"])
            sides[key] = dict(
                label=label, step=step, sampler=sampler, count=count, z=z, keep=keep, losses=losses
            )
        for s in sides.values():
            for i in range(args.warmup):
                s["step"](*data[i % len(data)])
            s["sampler"].on = True
            if s["z"] is not None:
                s["z"].peak_bytes = 0  # from here: the timed steps only
        steps = {key: s["step"] for key, s in sides.items()}
        if ctx.rank == 0:
            print(f"  timing {args.rounds} rounds × {args.steps} steps per side ...", flush=True)
        times = harness.interleaved_rounds(ctx, steps, lambda i: data[i % len(data)], args.rounds, args.steps)
        res = {}
        for key, s in sides.items():
            res[key] = {
                "label": s["label"],
                "losses": s["losses"],
                "rounds_ms": times[key],
                "peak_param_bytes": int(harness.rank_max(ctx, s["sampler"].peak)),
                "param_bytes_between_steps": int(harness.rank_max(ctx, s["count"]())),
                "exact_peak_param_bytes": int(harness.rank_max(ctx, s["z"].peak_bytes)) if s["z"] else None,
            }
        if ctx.rank == 0:
            harness.emit(out, res)
    finally:
        ctx.close()


# ------------------------------------------------------------------------------ run / report
def run(**kw) -> list[dict]:
    """Run the comparison (keyword overrides of DEFAULTS) and return one row per side; exits
    when the workers fail. Rows: benchmark, variant, side, step_ms, rounds_ms, ratio (FSDP2 /
    meshspeed step time, on the meshspeed row), peak_param_bytes, param_bytes_between_steps,
    exact_peak_param_bytes (meshspeed), losses, loss_ok, settings."""
    args = dict(DEFAULTS, **kw)
    unknown = set(args) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"zero3.run: unknown settings {sorted(unknown)}; valid: {sorted(DEFAULTS)}")
    if args["batch"] % args["nproc"]:
        raise ValueError(f"batch={args['batch']} must be a multiple of nproc={args['nproc']}")
    res = harness.spawn_collect(worker, args["nproc"], args, name="zero3 benchmark")
    ms, peer = res["meshspeed"], res["peer"]
    ok = harness.agree(peer["losses"], ms["losses"], harness.RTOL["float32"])
    ratio, lo, hi = harness.ratio(ms["rounds_ms"], peer["rounds_ms"])
    rows = []
    for key, r in (("meshspeed", ms), ("peer", peer)):
        rows.append(
            {
                "benchmark": "zero3",
                "variant": r["label"],
                "side": key,
                "step_ms": statistics.median(r["rounds_ms"]),
                "rounds_ms": r["rounds_ms"],
                "ratio": ratio if key == "meshspeed" else None,
                "ratio_range": [lo, hi] if key == "meshspeed" else None,
                "peak_param_bytes": r["peak_param_bytes"],
                "param_bytes_between_steps": r["param_bytes_between_steps"],
                "exact_peak_param_bytes": r["exact_peak_param_bytes"],
                "losses": r["losses"],
                "loss_ok": ok,
                "settings": args,
            }
        )
    return rows


def report(rows: list[dict]) -> None:
    s = rows[0]["settings"]
    print(
        f"\nZeRO-3 step, {s['model']} ({s['layers'] or 'preset'} layers) float32, "
        f"global batch {s['batch']} x seq {s['seq_len']}, dp {s['nproc']} gloo ranks; "
        f"median of {s['rounds']} rounds x {s['steps']} steps"
    )
    print(
        "loss check (steps 1, 2): "
        + "   ".join(f"{r['variant']} {r['losses'][0]:.6f} {r['losses'][1]:.6f}" for r in rows)
    )
    hdr = f"{'variant':<20} {'step ms':>9} {'peak param bytes/rank':>22} {'between steps':>14}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(
            f"{r['variant']:<20} {r['step_ms']:9.2f} {r['peak_param_bytes']:22,} "
            f"{r['param_bytes_between_steps']:14,}"
        )
    m = rows[0]
    lo, hi = m["ratio_range"]
    print(
        f"FSDP2/meshspeed step time {m['ratio']:.2f} (range {lo:.2f}-{hi:.2f}; > 1: meshspeed faster); "
        f"peak param bytes meshspeed/FSDP2 {m['peak_param_bytes'] / rows[1]['peak_param_bytes']:.3f}; "
        f"meshspeed exact peak {m['exact_peak_param_bytes']:,}"
    )
    if not m["loss_ok"]:
        print(harness.mismatch_note("meshspeed and FSDP2"))


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__)
    add = p.add_argument
    add("--nproc", type=int, default=DEFAULTS["nproc"], help="gloo ranks = dp (default 2)")
    add("--model", default=DEFAULTS["model"], choices=preset_names(), help="model preset (default small)")
    add("--layers", type=int, default=DEFAULTS["layers"], help="blocks (0 = the preset's; default 4)")
    add("--batch", type=int, default=DEFAULTS["batch"], help="global batch in sequences (default 8)")
    add("--seq-len", type=int, default=DEFAULTS["seq_len"], help="tokens per sequence (default 64)")
    add("--steps", type=int, default=DEFAULTS["steps"], help="timed steps per side per round (default 4)")
    add("--rounds", type=int, default=DEFAULTS["rounds"], help="interleaved rounds (default 3)")
    add("--warmup", type=int, default=DEFAULTS["warmup"], help="untimed steps per side (default 1)")
    add("--seed", type=int, default=0)
    add("--json", metavar="FILE", help="write the rows here")
    a = p.parse_args(argv)
    harness.require_positive(p, a, "nproc", "batch", "seq_len", "steps", "rounds")
    if a.batch % a.nproc:
        p.error(f"--batch={a.batch} must be a multiple of --nproc={a.nproc}")
    t0 = time.perf_counter()
    print(
        f"meshspeed ZeRO-3 vs FSDP2 (torch {torch.__version__}): {a.nproc} gloo ranks, model {a.model}",
        flush=True,
    )
    rows = run(**{k: v for k, v in vars(a).items() if k != "json"})
    report(rows)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    if a.json:
        harness.write_json(a.json, "rows", a, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
