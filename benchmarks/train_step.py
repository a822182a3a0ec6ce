"""meshspeed's parallel training step vs torch's own peers, side by side in one run.

Spawns N local gloo workers. Every variant trains the same model (same seeded weights) on the
same global batch, and a step is the full forward + backward + optimizer step (AdamW, lr 3e-4,
betas (0.9, 0.95), weight decay 0.1 on >= 2-D parameters, no gradient clipping on either side):

  dp     meshspeed build_data_parallel(zero=0)   vs  torch DistributedDataParallel + torch AdamW
  zero   meshspeed zero=1                        vs  DDP + torch ZeroRedundancyOptimizer(AdamW)
         meshspeed zero=1 and zero=2             vs  FSDP2 fully_shard (per layer + root) + AdamW
  tp     meshspeed parallelize (tp, dp = N/tp)   vs  DTensor parallelize_module (Colwise/Rowwise on
                                                     the same projections) + DDP over dp
  tp-sp  the same with sequence parallelism      vs  DTensor plan with SequenceParallel norms
                                                     (torchtitan's Llama plan) + DDP over dp

Before timing, each pair's losses on the first two steps are printed and compared (the second
one checks the optimizer update too); a mismatch is flagged: comparing different computations
would be worthless. Then, after `--warmup` untimed steps each, the variants of a config run
interleaved step by step (A B B A ..., benchmarks.harness.interleaved_rounds), `--steps` per
round; a step's time is the slowest rank's, a round's value its median. Reported: the median
over rounds, and the ratio peer / meshspeed (> 1: meshspeed faster) as the median of the
per-round ratios, with their range (read a range that straddles 1 as a tie). Memory is counted,
not timed: storage bytes per rank (max over ranks) of optimizer state, gradients and parameters
held between steps (after opt.step()).

Known differences, by design of each library (see the printed notes):
  - DTensor TP computes the loss as plain cross-entropy on logits gathered over the vocabulary
    ([batch, seq, V] on every tp rank); meshspeed keeps them vocab-sharded and runs a
    vocab-parallel cross-entropy. --loss-parallel gives the peer torch's loss_parallel() instead.
  - FSDP2 shards parameters too (ZeRO-3 layout); with the default reshard_after_forward=False
    it all-gathers them once per step and reduce-scatters gradients, the same traffic as
    meshspeed's zero=2 (reduce-scatter + all-gather of updated parameters).
  - On gloo, torch's reduce_scatter_tensor (what FSDP2 calls) is an all-reduce plus a slice,
    twice the traffic; meshspeed runs its own ring reduce-scatter there. That is the peer's
    real cost on this backend, not the benchmark's choice (on nccl both are native).
  - DDP runs at its fastest settings (benchmarks/peers.py); its first bucket is 1 MiB whatever
    --bucket-mb says. Over DTensor TP it composes through torch's TP + DDP recipe
    (_pre_dp_module_transform); with dp = 1 the TP peer has no DDP.
  - torch AdamW uses its fused CPU/CUDA kernel by default (the fastest torch has; --peer-adamw).
    meshspeed's ZeroAdamW runs over flat buckets. At zero >= 1 it keeps an fp32 master of its
    slice even for fp32 parameters, which the counted bytes show (torch: moments only).
  - --dtype bfloat16: meshspeed stores bf16 parameters with fp32 masters and fp32 gradient
    reduction; the peers use torch's idioms: fp32 parameters + autocast (DDP, DTensor TP) or
    MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) (FSDP2). Losses then agree only
    to bf16 precision.

    python -m benchmarks.train_step [--nproc 4] [--model tiny] [--configs dp,zero,tp,tp-sp]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import time
import traceback

import torch

from benchmarks import comm_choices, harness, peers
from meshspeed import comm
from meshspeed.models import cross_entropy_loss, get_preset, preset_names, recipe_for
from meshspeed.parallel.optim import build_data_parallel
from meshspeed.parallel.tensor import check_tp, model_loss, parallelize

CONFIGS = ("dp", "zero", "tp", "tp-sp")


# ------------------------------------------------------------------------------ runners
# One trainable variant: step(x, y) -> local loss (detached); memory() -> counted bytes; keep: its objects
Runner = collections.namedtuple("Runner", "step memory keep")


def fresh_model(args):
    return harness.preset_model(args.model, args.seq_len, args.seed)  # fp32; every variant starts from these


def autocast(args):
    bf16 = args.dtype != "float32"
    return torch.autocast("cpu", dtype=harness.DTYPES[args.dtype]) if bf16 else contextlib.nullcontext()


def build_meshspeed(args, mesh, zero: int, tp: int = 1, sp: bool = False) -> Runner:
    model = fresh_model(args)
    if tp > 1:
        recipe = recipe_for(model.config)
        check_tp(tp, recipe)
        parallelize(model, mesh, recipe, sequence_parallel=sp)
    kw = dict(lr=harness.LR, weight_decay=harness.WD, betas=harness.BETAS, eps=harness.EPS)
    dp, opt = build_data_parallel(
        model, mesh, zero=zero, bucket_mb=args.bucket_mb, dtype=harness.DTYPES[args.dtype], **kw
    )

    def memory():
        state = [
            t for st in opt.shards for t in (st.exp_avg, st.exp_avg_sq, st.master if st.owns_master else None)
        ]
        grads = [t for b in dp.buckets for t in (b.grad, b.grad_shard)]
        count = harness.storage_bytes
        out = {"state": count(state), "grads": count(grads), "params": count(model.parameters())}
        # The library's own accounting must agree with the storage count.
        out["api_agrees"] = out["state"] == opt.state_bytes() and out["grads"] == dp.grad_bytes()
        return out

    return Runner(harness.optimizer_step(opt, lambda x, y: model_loss(model, x, y)), memory, (model, dp, opt))


def peers_memory(opt) -> dict:
    return {**peers.counted_bytes(opt), "api_agrees": True}


def _torch_runner(args, model, wrapped, opt, cast: bool = True) -> Runner:
    """A peer's step: the same loss through torch's idioms (autocast for bf16, unless FSDP2's
    mixed-precision policy casts)."""

    def loss(x, y):
        with autocast(args) if cast else contextlib.nullcontext():
            return cross_entropy_loss(wrapped(x), y) + model.aux_loss()

    return Runner(harness.optimizer_step(opt, loss), lambda: peers_memory(opt), (model, wrapped, opt))


def build_ddp(args, mesh) -> Runner:
    model = fresh_model(args)
    wrapped = peers.ddp(model, mesh.device_mesh.get_group("dp"), args.bucket_mb)
    return _torch_runner(args, model, wrapped, peers.adamw(model, args.peer_adamw))


def build_ddp_zero1(args, mesh) -> Runner:
    model, group = fresh_model(args), mesh.device_mesh.get_group("dp")
    wrapped = peers.ddp(model, group, args.bucket_mb)
    return _torch_runner(args, model, wrapped, peers.zero_redundancy_adamw(model, group, args.peer_adamw))


def build_fsdp2(args, mesh) -> Runner:
    model = fresh_model(args)
    peers.fsdp2(model, mesh.device_mesh["dp"], args.fsdp_reshard_after_forward, harness.DTYPES[args.dtype])
    return _torch_runner(args, model, model, peers.adamw(model, args.peer_adamw), cast=False)


def build_dtensor_tp(args, mesh, sp: bool) -> Runner:
    from torch.distributed.tensor.parallel import loss_parallel

    model = peers.dtensor_tp(fresh_model(args), mesh.device_mesh["tp"], sp, args.loss_parallel)
    wrapped = model
    if mesh["dp"].size > 1:
        wrapped = peers.tp_ddp(model, mesh.device_mesh.get_group("dp"), args.bucket_mb)
    opt = peers.adamw(model, args.peer_adamw)
    lp = loss_parallel if args.loss_parallel else contextlib.nullcontext

    def step(x, y):
        opt.zero_grad()
        with lp():
            with autocast(args):
                logits = wrapped(x)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, -2).float(), y.flatten())
            loss.backward()
        opt.step()
        loss = loss.detach()
        return getattr(loss, "full_tensor", lambda: loss)()

    return Runner(step, lambda: peers_memory(opt), (model, wrapped, opt))


# ------------------------------------------------------------------------------ configs
def config_plan(name: str, args):
    """(ParallelDims kwargs, [(key, side, label, builder)], [(row label, ms key, peer key)])."""
    n, tp = args.nproc, args.tp
    if name == "dp":
        ms0 = ("ms0", "meshspeed", "meshspeed zero=0", lambda m: build_meshspeed(args, m, 0))
        return (
            dict(dp=n),
            [ms0, ("ddp", "peer", "DDP", lambda m: build_ddp(args, m))],
            [(f"dp={n} zero=0", "ms0", "ddp")],
        )
    if name == "zero":
        fs = f"FSDP2 (reshard_after_forward={args.fsdp_reshard_after_forward})"
        variants = [
            ("ms1", "meshspeed", "meshspeed zero=1", lambda m: build_meshspeed(args, m, 1)),
            ("ms2", "meshspeed", "meshspeed zero=2", lambda m: build_meshspeed(args, m, 2)),
            ("zro", "peer", "DDP+ZeroRedundancyOptimizer", lambda m: build_ddp_zero1(args, m)),
            ("fsdp", "peer", fs, lambda m: build_fsdp2(args, m)),
        ]
        rows = [
            (f"dp={n} zero=1", "ms1", "zro"),
            (f"dp={n} zero=1", "ms1", "fsdp"),
            (f"dp={n} zero=2", "ms2", "fsdp"),
        ]
        return dict(dp=n), variants, rows
    sp = name == "tp-sp"
    tag = (f"dp={n // tp} tp={tp}" if n % tp == 0 else f"tp={tp}") + (" sp" if sp else "")
    peer = "DTensor TP" + ("+SP" if sp else "") + (" +DDP" if n // tp > 1 else "")
    peer += " loss_parallel" if args.loss_parallel else ""
    ours = "meshspeed parallelize" + (" sp" if sp else "")
    variants = [
        ("mstp", "meshspeed", ours, lambda m: build_meshspeed(args, m, 0, tp, sp)),
        ("dttp", "peer", peer, lambda m: build_dtensor_tp(args, m, sp)),
    ]
    return dict(dp=n // tp, tp=tp), variants, [(tag, "mstp", "dttp")]


def _short(err: BaseException) -> str:
    msg = " ".join(str(err).split()) or type(err).__name__
    return f"{type(err).__name__}: {msg}"[:160]


def run_config(ctx, name: str, args, log) -> dict:
    dims, variants, rows = config_plan(name, args)
    if args.nproc % dims.get("tp", 1):
        reason = f"--tp={args.tp} does not divide --nproc={args.nproc}"
        return {
            "variants": {k: {"label": lab, "side": side, "error": reason} for k, side, lab, _ in variants},
            "rows": rows,
        }
    mesh = comm.ParallelDims(**dims).build(ctx)
    dp = mesh["dp"]
    data = harness.token_batches(
        args.seed, get_preset(args.model).vocab_size, args.batch, args.seq_len, mesh.coords["dp"], dp.size
    )
    res: dict = {}
    runners: dict = {}
    for key, side, label, build in variants:
        res[key] = {"label": label, "side": side, "error": None}
        try:
            torch.manual_seed(args.seed)
            runners[key] = build(mesh)
            res[key]["losses"] = harness.first_losses(runners[key].step, data, dp)
            res[key]["memory"] = runners[key].memory()
            err = None
        except Exception as e:  # a peer that cannot run on this torch is a table row, not the end
            err = _short(e)
            if ctx.rank == 0 and args.verbose:
                traceback.print_exc()
        if not harness.all_ranks_ok(ctx, err is None):
            res[key]["error"] = err or "failed on another rank"
            runners.pop(key, None)
            continue
        mem = res[key]["memory"]
        for k in ("state", "grads", "params"):  # per rank, the largest
            mem[k] = int(harness.rank_max(ctx, mem[k]))
        # one more step, to read which algorithm each of its collectives ran
        res[key]["algos"] = comm_choices.used(ctx, lambda: runners[key].step(*data[0]))
        if side == "peer":
            res[key]["algos"] = {"all": "torch.distributed's own (native)"}
    for runner in runners.values():
        for i in range(args.warmup):
            runner.step(*data[i % len(data)])
    times = harness.interleaved_rounds(
        ctx,
        {key: r.step for key, r in runners.items()},
        lambda s: data[s % len(data)],
        args.rounds,
        args.steps,
        on_round=lambda r: log(f"  {name}: round {r + 1}/{args.rounds} done"),
    )
    for key, ms in times.items():
        res[key]["times_ms"] = ms
    runners.clear()
    return {"variants": res, "rows": rows}


def worker(args_dict: dict, out: str) -> None:
    args = argparse.Namespace(**args_dict)
    torch.manual_seed(args.seed)
    ctx = comm.init()
    log = (lambda s: print(s, flush=True)) if ctx.rank == 0 else (lambda s: None)
    try:
        results = {}
        for name in args.configs:
            t0 = time.perf_counter()
            log(f"[{name}] building, checking losses, timing ...")
            results[name] = run_config(ctx, name, args, log)
            log(f"[{name}] {time.perf_counter() - t0:.1f} s")
        if ctx.rank == 0:
            harness.emit(out, results)
    finally:
        ctx.close()


# ------------------------------------------------------------------------------ report
def _fmt_bytes(n: int) -> str:
    return f"{n / 2**20:8.3f} MiB"


def _cell(x: float | None, spec: str) -> str:
    """x formatted, or "-" in the same width when there is no x."""
    return format(x, spec) if x is not None else "-".rjust(int(spec.split(".")[0]))


def report(results: dict, args) -> tuple[list[dict], bool]:
    tokens = args.batch * args.seq_len
    rtol = harness.RTOL[args.dtype]
    rows_out, mismatch = [], False
    print("\nloss check (global mean loss of steps 1 and 2; step 2 follows one AdamW update):")
    for name, cfg in results.items():
        for tag, ms_key, peer_key in cfg["rows"]:
            a, b = cfg["variants"][ms_key], cfg["variants"][peer_key]
            if a.get("error") or b.get("error"):
                print(f"  {tag:<20} {a['label']} vs {b['label']}: not compared (a variant failed)")
                continue
            diff = harness.rel_diff(a["losses"], b["losses"])
            mismatch |= diff > rtol
            print(
                f"  {tag:<20} {a['label']:<26} {a['losses'][0]:.6f} {a['losses'][1]:.6f}   "
                f"{b['label']:<34} {b['losses'][0]:.6f} {b['losses'][1]:.6f}   "
                f"{'MISMATCH' if diff > rtol else 'ok'} (max rel diff {diff:.1e}, tol {rtol:.0e})"
            )
    print(
        f"\ntraining step, {args.model} {args.dtype}, global batch {args.batch} x seq {args.seq_len} "
        f"= {tokens} tokens, {args.nproc} ranks; median of {args.rounds} rounds x {args.steps} steps "
        f"(after {args.warmup} warmup)"
    )
    hdr = (
        f"{'config':<18} {'meshspeed':<24} {'ms':>8}   {'peer':<36} {'ms':>8} {'peer/meshspeed':>15} "
        f"{'range':>12} {'ms tok/s':>9} {'peer tok/s':>10}"
    )
    print(hdr)
    print("-" * len(hdr))
    for name, cfg in results.items():
        for tag, ms_key, peer_key in cfg["rows"]:
            a, b = cfg["variants"][ms_key], cfg["variants"][peer_key]
            ta, tb = a.get("times_ms"), b.get("times_ms")
            row = {"config": tag, "meshspeed": a["label"], "peer": b["label"], "ratio": None}
            row["error"] = a.get("error") or b.get("error")
            row["meshspeed_ms"], row["peer_ms"] = (statistics.median(t) if t else None for t in (ta, tb))
            for key, t in (("meshspeed_rounds_ms", ta), ("peer_rounds_ms", tb)):
                if t:
                    row[key] = t
            if ta and tb:
                row["ratio"], *row["ratio_range"] = harness.ratio(ta, tb)
            rng = "{:.2f}-{:.2f}".format(*row["ratio_range"]) if row["ratio"] else "-"
            ms, peer = row["meshspeed_ms"], row["peer_ms"]
            tps = [_cell(tokens / t * 1e3 if t else None, f) for t, f in ((ms, "9.0f"), (peer, "10.0f"))]
            labels = [s["label"] + (" FAILED" if s.get("error") else "") for s in (a, b)]
            print(
                f"{tag:<18} {labels[0]:<24} {_cell(ms, '8.2f')}   {labels[1]:<36} {_cell(peer, '8.2f')} "
                f"{_cell(row['ratio'], '15.2f')} {rng:>12} {tps[0]} {tps[1]}"
            )
            for side in (a, b):
                if side.get("error"):
                    print(f"{'':<18}   ^ {side['label']}: {side['error']}")
            rows_out.append(row)
    print("ratio = peer / meshspeed step time (> 1: meshspeed faster); range: lowest-highest per-round ratio")
    print("\ncollective algorithms one step ran (rank 0; calls per algorithm):")
    for name, cfg in results.items():
        for v in cfg["variants"].values():
            if not v.get("error") and "algos" in v:
                print(f"  {name:<6} {v['label']:<38} {comm_choices.describe(v['algos'])}")
    print(
        "\ncounted bytes per rank (max over ranks), held between steps: storage of optimizer state, "
        f"gradients, parameters ({args.model}, {args.dtype})"
    )
    mhdr = f"{'config':<14} {'variant':<38} {'opt state':>13} {'grads':>13} {'params':>13} {'total':>13}"
    print(mhdr)
    print("-" * len(mhdr))
    for name, cfg in results.items():
        dims = cfg["rows"][0][0].replace(" zero=0", "").replace(" zero=1", "")
        for key, v in cfg["variants"].items():
            if v.get("error") or "memory" not in v:
                continue
            m = v["memory"]
            total = m["state"] + m["grads"] + m["params"]
            flag = "" if m.get("api_agrees", True) else "  (!) differs from opt.state_bytes()/dp.grad_bytes()"
            print(
                f"{dims:<14} {v['label']:<38} {_fmt_bytes(m['state'])} {_fmt_bytes(m['grads'])} "
                f"{_fmt_bytes(m['params'])} {_fmt_bytes(total)}{flag}"
            )
            row = {"config": dims, "variant": v["label"], "side": v["side"], "state_bytes": m["state"]}
            rows_out.append(dict(row, grad_bytes=m["grads"], param_bytes=m["params"]))
    if mismatch:
        print("\n" + harness.mismatch_note("a meshspeed variant and its peer"))
    return rows_out, mismatch


def parse_args(argv):
    p = harness.parser(__doc__)
    add = p.add_argument
    add("--nproc", type=int, default=4, help="local gloo worker processes (default 4)")
    add("--model", default="tiny", choices=preset_names(), help="model preset (default tiny)")
    add("--dtype", default="float32", choices=list(harness.DTYPES), help="compute dtype (default float32)")
    add("--batch", type=int, default=16, help="global batch in sequences, split over dp (default 16)")
    add("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    add(
        "--steps",
        type=int,
        default=6,
        help="timed steps per variant per round, their median kept (default 6)",
    )
    add("--rounds", type=int, default=8, help="interleaved rounds; the median is reported (default 8)")
    add("--warmup", type=int, default=3, help="untimed steps per variant before the rounds (default 3)")
    add(
        "--tp",
        type=int,
        default=2,
        help="tensor-parallel degree of the tp configs (default 2; dp = nproc/tp)",
    )
    add("--bucket-mb", type=float, default=25.0, help="gradient bucket MiB, meshspeed and DDP (default 25)")
    add("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {','.join(CONFIGS)}")
    add(
        "--peer-adamw",
        default="fused",
        choices=list(peers.ADAMW_IMPLS),
        help="peers' torch AdamW (default fused)",
    )
    add(
        "--fsdp-reshard-after-forward",
        type=lambda s: s.lower() in ("1", "true", "yes"),
        default=False,
        metavar="BOOL",
        help="FSDP2's reshard_after_forward (default false: ZeRO-2-like traffic; true: ZeRO-3)",
    )
    add(
        "--loss-parallel",
        action="store_true",
        help="DTensor peer computes the loss with torch's loss_parallel() (vocab-parallel, like meshspeed) "
        "instead of cross-entropy on gathered logits",
    )
    add("--seed", type=int, default=0)
    add("--json", metavar="FILE", help="write the rows (timings, ratios, counted bytes, settings) here")
    add("--verbose", action="store_true", help="print tracebacks of variants that fail")
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in args.configs if c not in CONFIGS]
    if bad:
        p.error(f"--configs: unknown {', '.join(bad)}; valid: {', '.join(CONFIGS)}")
    harness.require_positive(p, args, "nproc", "batch", "seq_len", "steps", "rounds", "tp")
    if args.warmup < 0:
        p.error(f"--warmup={args.warmup} must be >= 0")
    if args.batch % args.nproc:
        p.error(
            f"--batch={args.batch} must be a multiple of --nproc={args.nproc} (dp ranks take batch/dp rows)"
        )
    if "tp-sp" in args.configs and args.seq_len % args.tp:
        p.error(f"--seq-len={args.seq_len} must be a multiple of --tp={args.tp} for sequence parallelism")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    print(
        f"meshspeed vs torch {torch.__version__}: {args.nproc} gloo ranks, model {args.model}, {args.dtype}, "
        f"configs {','.join(args.configs)}",
        flush=True,
    )
    rows, mismatch = [], False
    # With a saved `bench comm` file, run under it and under the built-in defaults: a
    # calibration must never make a run slower, and this is where that is seen.
    for label, value in comm_choices.param_sets():
        print(f"\n=== {label} ===", flush=True)
        with comm_choices.link_params(value):
            results = harness.spawn_collect(worker, args.nproc, vars(args), name="train_step benchmark")
        set_rows, set_mismatch = report(results, args)
        rows += [dict(r, link_params=label) for r in set_rows]
        mismatch |= set_mismatch
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    if args.json:
        harness.write_json(args.json, "rows", args, loss_mismatch=mismatch, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
