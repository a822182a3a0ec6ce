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

    python benchmarks/zero3.py [--nproc 2] [--model small] [--layers 4] [--json rows.json]
    from benchmarks.zero3 import run; rows = run(nproc=2)        # for benchmarks/memory.py
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from meshspeed import comm  # noqa: E402
from meshspeed.models import build_model, cross_entropy_loss, get_preset, preset_names  # noqa: E402
from meshspeed.parallel.optim import build_data_parallel  # noqa: E402

LR, BETAS, EPS, WD = 3e-4, (0.9, 0.95), 1e-8, 0.1
RTOL = 1e-5
DEFAULTS = dict(
    nproc=2, model="small", layers=4, batch=8, seq_len=64, steps=4, rounds=3, warmup=1, seed=0, verbose=False
)


# ------------------------------------------------------------------------------ counting bytes
def _storages(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        t = getattr(t, "_local_tensor", t)  # DTensor -> this rank's piece
        s = t.untyped_storage()
        if s.nbytes():
            seen[s._cdata] = s.nbytes()
    return sum(seen.values())


def fsdp2_param_bytes(model) -> int:
    """Parameter storage FSDP2 holds on this rank now (its internals, read only)."""
    out = []
    for m in model.modules():
        state = m._get_fsdp_state() if hasattr(m, "_get_fsdp_state") else None
        if state is None:
            continue
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            groups = [g] if (g := getattr(state, "_fsdp_param_group", None)) is not None else []
        for g in groups:
            for fp in g.fsdp_params:
                out += [fp._sharded_param_data, getattr(fp, "_unsharded_param", None), *fp.all_gather_outputs]
            if (r := getattr(g, "_all_gather_result", None)) is not None:
                out.append(r.all_gather_output)
            if (s := getattr(g.comm_ctx, "all_gather_state", None)) is not None:
                out.append(s.all_gather_result.all_gather_output)
    return _storages(out)


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
    cfg = get_preset(args.model, **({"n_layers": args.layers} if args.layers else {}))
    if args.seq_len > cfg.max_seq_len:
        cfg = get_preset(
            args.model, max_seq_len=args.seq_len, **({"n_layers": args.layers} if args.layers else {})
        )
    return build_model(cfg, seed=args.seed)


def _step(model, opt):
    """One training step, the same on both sides: loss, backward, optimizer step."""

    def step(x, y):
        opt.zero_grad()
        loss = cross_entropy_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def build_meshspeed(args, mesh):
    model = _model(args)
    dp, opt = build_data_parallel(
        model, mesh, zero=3, dtype=torch.float32, units="layers", lr=LR, weight_decay=WD, betas=BETAS, eps=EPS
    )
    z = dp.zero3

    return _step(model, opt), Sampler(model, z.live_param_bytes), z.live_param_bytes, z, (model, dp, opt)


def build_fsdp2(args, mesh):
    # peer being compared: FSDP2 (torch >= 2.6 exports it from torch.distributed.fsdp)
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard

    model = _model(args)
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh.device_mesh["dp"], reshard_after_forward=True)
    fully_shard(model, mesh=mesh.device_mesh["dp"], reshard_after_forward=True)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS)

    count = lambda: fsdp2_param_bytes(model)  # noqa: E731
    return _step(model, opt), Sampler(model, count), count, None, (model, opt)


SIDES = (("meshspeed", "meshspeed zero=3", build_meshspeed), ("peer", "FSDP2 fully_shard", build_fsdp2))


# ------------------------------------------------------------------------------ worker
def _batches(args, vocab: int, rank: int, dp: int, n: int = 4):
    g = torch.Generator().manual_seed(args.seed + 1)
    rows, out = args.batch // dp, []
    for _ in range(n):
        t = torch.randint(0, vocab, (args.batch, args.seq_len + 1), generator=g)[
            rank * rows : (rank + 1) * rows
        ]
        out.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
    return out


def _max(ctx, x: float) -> float:
    return comm.all_reduce(torch.tensor([float(x)], dtype=torch.float64), ctx.world, "max").item()


def worker(args_dict: dict, out_path: str) -> None:
    args = argparse.Namespace(**args_dict)
    # the sampling hooks on the embedding (whose input needs no gradient) and FSDP2's root output
    # (a view) make torch warn on every step; neither changes what is computed
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    ctx = comm.init()
    try:
        mesh = comm.ParallelDims(dp=ctx.world_size).build(ctx)
        data = _batches(args, _model(args).config.vocab_size, ctx.rank, ctx.world_size)
        sides = {}
        for key, label, build in SIDES:
            torch.manual_seed(args.seed)
            step, sampler, count, z, keep = build(args, mesh)
            losses = []
            for i in range(2):  # step 1: same weights and batch; step 2: after one AdamW update
                loss = step(*data[i]).reshape(1).clone()
                losses.append(comm.all_reduce(loss, mesh["dp"], "avg").item())
            sides[key] = dict(
                label=label, step=step, sampler=sampler, count=count, z=z, keep=keep, losses=losses
            )
        for s in sides.values():
            for i in range(args.warmup):
                s["step"](*data[i % len(data)])
            s["sampler"].on, s["times"] = True, []
            if s["z"] is not None:
                s["z"].peak_bytes = 0  # from here: the timed steps only
        order = list(sides)
        for r in range(args.rounds):
            local = {k: [] for k in order}
            gc.collect()
            gc.disable()
            for i in range(args.steps):
                for key in order if (r * args.steps + i) % 2 == 0 else order[::-1]:
                    comm.barrier(ctx.world)
                    t0 = time.perf_counter()
                    sides[key]["step"](*data[i % len(data)])
                    local[key].append(time.perf_counter() - t0)
            gc.enable()
            for key in order:
                slowest = comm.all_reduce(torch.tensor(local[key], dtype=torch.float64), ctx.world, "max")
                sides[key]["times"].append(statistics.median(slowest.tolist()) * 1e3)
        out = {}
        for key, s in sides.items():
            out[key] = {
                "label": s["label"],
                "losses": s["losses"],
                "rounds_ms": s["times"],
                "peak_param_bytes": int(_max(ctx, s["sampler"].peak)),
                "param_bytes_between_steps": int(_max(ctx, s["count"]())),
                "exact_peak_param_bytes": int(_max(ctx, s["z"].peak_bytes)) if s["z"] is not None else None,
            }
        if ctx.rank == 0:
            with open(out_path, "w") as f:
                json.dump(out, f)
    finally:
        ctx.close()


# ------------------------------------------------------------------------------ run / report
def _importable_worker():
    """`worker` as module `zero3` of this directory: spawned processes import it by name, which
    fails for a file loaded under another name (benchmarks/memory.py loads it from its path)."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)  # spawned processes start with the parent's sys.path
    return importlib.import_module("zero3").worker


def run(**kw) -> list[dict]:
    """Run the comparison (keyword overrides of DEFAULTS) and return one row per side; raises
    when the workers fail. Rows: benchmark, variant, side, step_ms, rounds_ms, ratio (FSDP2 /
    meshspeed step time, on the meshspeed row), peak_param_bytes, param_bytes_between_steps,
    exact_peak_param_bytes (meshspeed), losses, loss_ok, settings."""
    args = dict(DEFAULTS, **kw)
    unknown = set(args) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"zero3.run: unknown settings {sorted(unknown)}; valid: {sorted(DEFAULTS)}")
    if args["batch"] % args["nproc"]:
        raise ValueError(f"batch={args['batch']} must be a multiple of nproc={args['nproc']}")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "zero3.json")
        code = comm.spawn(_importable_worker(), args["nproc"], (args, path))
        if code or not os.path.exists(path):
            raise RuntimeError(f"zero3 benchmark: the workers failed (exit code {code}; see above)")
        with open(path) as f:
            res = json.load(f)
    ms, peer = res["meshspeed"], res["peer"]
    ok = all(abs(a - b) <= RTOL * abs(b) for a, b in zip(ms["losses"], peer["losses"]))
    ratios = [p / m for m, p in zip(ms["rounds_ms"], peer["rounds_ms"])]
    rows = []
    for key, r in (("meshspeed", ms), ("peer", peer)):
        rows.append(
            {
                "benchmark": "zero3",
                "variant": r["label"],
                "side": key,
                "step_ms": statistics.median(r["rounds_ms"]),
                "rounds_ms": r["rounds_ms"],
                "ratio": statistics.median(ratios) if key == "meshspeed" else None,
                "ratio_range": [min(ratios), max(ratios)] if key == "meshspeed" else None,
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
        print(
            "(!) LOSS MISMATCH: meshspeed and FSDP2 computed different losses; their times are not comparable"
        )


def main(argv: list[str] | None = None) -> int:
    doc = __doc__.split("\n\n")
    p = argparse.ArgumentParser(
        description=doc[0], epilog="\n\n".join(doc[1:]), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nproc", type=int, default=DEFAULTS["nproc"], help="gloo ranks = dp (default 2)")
    p.add_argument(
        "--model", default=DEFAULTS["model"], choices=preset_names(), help="model preset (default small)"
    )
    p.add_argument(
        "--layers", type=int, default=DEFAULTS["layers"], help="blocks (0 = the preset's; default 4)"
    )
    p.add_argument(
        "--batch", type=int, default=DEFAULTS["batch"], help="global batch in sequences (default 8)"
    )
    p.add_argument(
        "--seq-len", type=int, default=DEFAULTS["seq_len"], help="tokens per sequence (default 64)"
    )
    p.add_argument(
        "--steps", type=int, default=DEFAULTS["steps"], help="timed steps per side per round (default 4)"
    )
    p.add_argument("--rounds", type=int, default=DEFAULTS["rounds"], help="interleaved rounds (default 3)")
    p.add_argument(
        "--warmup", type=int, default=DEFAULTS["warmup"], help="untimed steps per side (default 1)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="write the rows here")
    a = p.parse_args(argv)
    for k in ("nproc", "batch", "seq_len", "steps", "rounds"):
        if getattr(a, k) < 1:
            p.error(f"--{k.replace('_', '-')}={getattr(a, k)} must be >= 1")
    if a.batch % a.nproc:
        p.error(f"--batch={a.batch} must be a multiple of --nproc={a.nproc}")
    t0 = time.perf_counter()
    print(
        f"meshspeed ZeRO-3 vs FSDP2 (torch {torch.__version__}): {a.nproc} gloo ranks, model {a.model}",
        flush=True,
    )
    settings = {k: v for k, v in vars(a).items() if k != "json"}
    rows = run(**settings)
    report(rows)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"torch": torch.__version__, "rows": rows}, f, indent=1)
        print(f"rows written to {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
