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
interleaved step by step, the order reversed every other step (A B B A ...), `--steps` timed
steps of each per round. A step's time is the slowest rank's (ranks start each timed step
together); a round's value is the median of its steps. Reported: the median over rounds, and
the ratio peer / meshspeed (> 1: meshspeed faster) as the median of the per-round
ratios, with their range (2-core machines are noisy; read a ratio whose range straddles 1 as
a tie). Memory is counted, not timed: storage bytes per rank (max over ranks) of optimizer
state, gradients and parameters held between steps (after opt.step()).

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
  - DDP is built with gradient_as_bucket_view=True and no per-forward buffer sync (the model's
    only buffers are constant RoPE tables), its fastest settings; its first bucket is 1 MiB
    whatever --bucket-mb says. Over DTensor TP it composes through torch's
    _pre_dp_module_transform (its TP + DDP recipe); with dp = 1 the TP peer has no DDP.
  - torch AdamW uses its fused CPU/CUDA kernel by default (the fastest torch has; --peer-adamw).
    meshspeed's ZeroAdamW runs over flat buckets. At zero >= 1 it keeps an fp32 master of its
    slice even for fp32 parameters, which the counted bytes show (torch: moments only).
  - --dtype bfloat16: meshspeed stores bf16 parameters with fp32 masters and fp32 gradient
    reduction; the peers use torch's idioms: fp32 parameters + autocast (DDP, DTensor TP) or
    MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) (FSDP2). Losses then agree only
    to bf16 precision.

    python benchmarks/train_step.py [--nproc 4] [--model tiny] [--configs dp,zero,tp,tp-sp]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import os
import statistics
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from meshspeed import comm  # noqa: E402
from meshspeed.models import build_model, cross_entropy_loss, get_preset, preset_names, recipe_for  # noqa: E402
from meshspeed.parallel.optim import build_data_parallel  # noqa: E402
from meshspeed.parallel.tensor import check_tp, model_loss, parallelize  # noqa: E402

CONFIGS = ("dp", "zero", "tp", "tp-sp")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LR, BETAS, EPS, WD = 3e-4, (0.9, 0.95), 1e-8, 0.1
RTOL = {"float32": 1e-5, "bfloat16": 3e-2}  # relative loss tolerance of the equivalence check


# ------------------------------------------------------------------------------ counting bytes
def counted_bytes(tensors) -> int:
    """Sum of storage sizes over the unique storages behind `tensors` (DTensors: their local
    shard). Views of one buffer count once; a released (resized-to-0) storage counts 0."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        t = getattr(t, "_local_tensor", t)  # DTensor -> this rank's shard
        s = t.untyped_storage()
        if s.nbytes():
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def torch_opt_state(opt) -> list[torch.Tensor]:
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer: the local optimizer's state
    return [v for st in inner.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


# ------------------------------------------------------------------------------ runners
class Runner:
    """One trainable variant: step(x, y) -> local loss (detached); memory() -> counted bytes."""

    def __init__(self, step, memory, keep):
        self.step, self.memory, self.keep = step, memory, keep


def fresh_model(args):
    cfg = get_preset(args.model)
    if args.seq_len > cfg.max_seq_len:
        cfg = get_preset(args.model, max_seq_len=args.seq_len)
    return build_model(cfg, seed=args.seed)  # fp32; every variant starts from these weights


def adamw_groups(model):
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}]


def adamw_kwargs(args) -> dict:
    impl = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[
        args.peer_adamw
    ]
    return dict(lr=LR, betas=BETAS, eps=EPS, **impl)


def autocast(args):
    if args.dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type="cpu", dtype=DTYPES[args.dtype])


def build_meshspeed(args, mesh, zero: int, tp: int = 1, sp: bool = False) -> Runner:
    model = fresh_model(args)
    if tp > 1:
        recipe = recipe_for(model.config)
        check_tp(tp, recipe)
        parallelize(model, mesh, recipe, sequence_parallel=sp)
    dp, opt = build_data_parallel(
        model,
        mesh,
        zero=zero,
        bucket_mb=args.bucket_mb,
        dtype=DTYPES[args.dtype],
        lr=LR,
        weight_decay=WD,
        betas=BETAS,
        eps=EPS,
    )

    def step(x, y):
        opt.zero_grad()
        loss = model_loss(model, x, y)
        loss.backward()
        opt.step()
        return loss.detach()

    def memory():
        state = [
            t
            for st in opt.shards
            for t in (st.exp_avg, st.exp_avg_sq) + ((st.master,) if st.owns_master else ())
        ]
        grads = [t for b in dp.buckets for t in (b.grad, b.grad_shard)]
        out = {
            "state": counted_bytes(state),
            "grads": counted_bytes(grads),
            "params": counted_bytes(model.parameters()),
        }
        # The library's own accounting must agree with the storage count.
        out["api_agrees"] = out["state"] == opt.state_bytes() and out["grads"] == dp.grad_bytes()
        return out

    return Runner(step, memory, (model, dp, opt))


def _torch_step(model, wrapped, opt, args):
    def step(x, y):
        opt.zero_grad()
        with autocast(args):
            loss = cross_entropy_loss(wrapped(x), y) + model.aux_loss()
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def _torch_memory(model, opt):
    # The tensors the optimizer trains, not model.parameters(): after a forward,
    # _pre_dp_module_transform's hook has put fresh (grad-less) Parameter objects on the model.
    # (ZeroRedundancyOptimizer's param_groups hold every parameter, not only its partition.)
    params = [p for g in opt.param_groups for p in g["params"]]

    def memory():
        return {
            "state": counted_bytes(torch_opt_state(opt)),
            "grads": counted_bytes(p.grad for p in params),
            "params": counted_bytes(params),
            "api_agrees": True,
        }

    return memory


def _ddp(model, mesh, args):
    # peer being compared: torch's own data parallelism
    from torch.nn.parallel import DistributedDataParallel

    # The only buffers are the constant RoPE tables: no per-forward buffer broadcast (torch 2.13
    # renamed the switch; broadcast_buffers=False is the older spelling).
    kw = (
        {"forward_sync_buffers": False}
        if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
        else {"broadcast_buffers": False}
    )
    return DistributedDataParallel(
        model,
        process_group=mesh.device_mesh.get_group("dp"),
        bucket_cap_mb=args.bucket_mb,
        gradient_as_bucket_view=True,
        **kw,
    )


def build_ddp(args, mesh) -> Runner:
    model = fresh_model(args)
    ddp = _ddp(model, mesh, args)
    opt = torch.optim.AdamW(adamw_groups(model), **adamw_kwargs(args))
    return Runner(_torch_step(model, ddp, opt, args), _torch_memory(model, opt), (model, ddp, opt))


def build_ddp_zero1(args, mesh) -> Runner:
    # peer being compared: torch's ZeRO-1 optimizer over DDP
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = fresh_model(args)
    ddp = _ddp(model, mesh, args)
    opt = ZeroRedundancyOptimizer(
        adamw_groups(model),
        optimizer_class=torch.optim.AdamW,
        process_group=mesh.device_mesh.get_group("dp"),
        **adamw_kwargs(args),
    )
    return Runner(_torch_step(model, ddp, opt, args), _torch_memory(model, opt), (model, ddp, opt))


def build_fsdp2(args, mesh) -> Runner:
    # peer being compared: FSDP2 (torch >= 2.6 exports it from torch.distributed.fsdp)
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard

    model = fresh_model(args)
    kw = dict(mesh=mesh.device_mesh["dp"], reshard_after_forward=args.fsdp_reshard_after_forward)
    if args.dtype != "float32":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=DTYPES[args.dtype], reduce_dtype=torch.float32)
    for layer in model.layers.values():
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    opt = torch.optim.AdamW(adamw_groups(model), **adamw_kwargs(args))

    def step(x, y):
        opt.zero_grad()
        loss = cross_entropy_loss(model(x), y) + model.aux_loss()
        loss.backward()
        opt.step()
        return loss.detach()

    return Runner(step, _torch_memory(model, opt), (model, opt))


def dtensor_plan(sp: bool, loss_parallel: bool) -> tuple[dict, dict]:
    """(model-level, per-block) plans: torchtitan's Llama plan, on the projections meshspeed splits."""
    # peer being compared: DTensor tensor parallelism
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    seq = Shard(1) if sp else Replicate()
    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    if sp:
        plan["norm"] = SequenceParallel()
    layer = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=seq),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=seq),
    }
    if sp:
        layer.update(
            {
                "attention_norm": SequenceParallel(),
                "ffn_norm": SequenceParallel(),
                # Attention.forward(x, cos, sin) / FeedForward.forward(x): gather the sequence first.
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
                ),
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
            }
        )
    return plan, layer


def build_dtensor_tp(args, mesh, sp: bool) -> Runner:
    # peer being compared: DTensor tensor parallelism (+ DDP over dp, torch's TP+DDP composition)
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
    from torch.distributed.tensor.parallel.ddp import _pre_dp_module_transform

    model = fresh_model(args)
    if model.config.is_moe:
        raise NotImplementedError(
            "this benchmark has no DTensor plan for MoE layers (torchtitan shards experts "
            "with expert parallelism instead); use a dense --model"
        )
    tp_mesh = mesh.device_mesh["tp"]
    top, layer = dtensor_plan(sp, args.loss_parallel)
    parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, layer)
    wrapped = model
    if mesh["dp"].size > 1:
        _pre_dp_module_transform(model)
        wrapped = _ddp(model, mesh, args)
    opt = torch.optim.AdamW(adamw_groups(model), **adamw_kwargs(args))
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

    return Runner(step, _torch_memory(model, opt), (model, wrapped, opt))


# ------------------------------------------------------------------------------ configs
def config_plan(name: str, args):
    """(ParallelDims kwargs, [(key, side, label, builder)], [(row label, ms key, peer key)])."""
    n, tp = args.nproc, args.tp
    fs = f"FSDP2 (reshard_after_forward={args.fsdp_reshard_after_forward})"
    if name == "dp":
        return (
            dict(dp=n),
            [
                ("ms0", "meshspeed", "meshspeed zero=0", lambda m: build_meshspeed(args, m, 0)),
                ("ddp", "peer", "DDP", lambda m: build_ddp(args, m)),
            ],
            [(f"dp={n} zero=0", "ms0", "ddp")],
        )
    if name == "zero":
        return (
            dict(dp=n),
            [
                ("ms1", "meshspeed", "meshspeed zero=1", lambda m: build_meshspeed(args, m, 1)),
                ("ms2", "meshspeed", "meshspeed zero=2", lambda m: build_meshspeed(args, m, 2)),
                ("zro", "peer", "DDP+ZeroRedundancyOptimizer", lambda m: build_ddp_zero1(args, m)),
                ("fsdp", "peer", fs, lambda m: build_fsdp2(args, m)),
            ],
            [
                (f"dp={n} zero=1", "ms1", "zro"),
                (f"dp={n} zero=1", "ms1", "fsdp"),
                (f"dp={n} zero=2", "ms2", "fsdp"),
            ],
        )
    sp = name == "tp-sp"
    dims = dict(dp=n // tp, tp=tp)
    tag = (f"dp={n // tp} tp={tp}" if n % tp == 0 else f"tp={tp}") + (" sp" if sp else "")
    peer = (
        "DTensor TP"
        + ("+SP" if sp else "")
        + (" +DDP" if n // tp > 1 else "")
        + (" loss_parallel" if args.loss_parallel else "")
    )
    return (
        dims,
        [
            (
                "mstp",
                "meshspeed",
                "meshspeed parallelize" + (" sp" if sp else ""),
                lambda m: build_meshspeed(args, m, 0, tp, sp),
            ),
            ("dttp", "peer", peer, lambda m: build_dtensor_tp(args, m, sp)),
        ],
        [(tag, "mstp", "dttp")],
    )


def _short(err: BaseException) -> str:
    msg = " ".join(str(err).split()) or type(err).__name__
    return f"{type(err).__name__}: {msg}"[:160]


def agree(ctx, ok: bool) -> bool:
    """True when every rank says ok (so all ranks skip a failed variant together)."""
    if ctx.world_size == 1:
        return ok
    return bool(comm.all_reduce(torch.tensor([1.0 if ok else 0.0]), ctx.world, "min").item())


def batches(args, vocab: int, dp_rank: int, dp: int, n: int = 4):
    """n global batches [batch, seq+1] of random tokens; this dp rank's rows of each."""
    g = torch.Generator().manual_seed(args.seed + 1)
    out = []
    rows = args.batch // dp
    for _ in range(n):
        t = torch.randint(0, vocab, (args.batch, args.seq_len + 1), generator=g)[
            dp_rank * rows : (dp_rank + 1) * rows
        ]
        out.append((t[:, :-1].contiguous(), t[:, 1:].contiguous()))
    return out


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
    data = batches(args, get_preset(args.model).vocab_size, mesh.coords["dp"], dp.size)
    res: dict = {}
    runners: dict = {}
    for key, side, label, build in variants:
        res[key] = {"label": label, "side": side, "error": None}
        try:
            torch.manual_seed(args.seed)
            runners[key] = build(mesh)
            losses = []
            for i in range(2):  # step 1: same weights, same batch; step 2: after one AdamW update
                loss = runners[key].step(*data[i]).float().reshape(1).clone()
                losses.append(comm.all_reduce(loss, dp, "avg").item())
            res[key]["losses"] = losses
            res[key]["memory"] = runners[key].memory()
            err = None
        except Exception as e:  # noqa: BLE001 - a peer that cannot run on this torch is a table row
            err = _short(e)
            if ctx.rank == 0 and args.verbose:
                traceback.print_exc()
        if not agree(ctx, err is None):
            res[key]["error"] = err or "failed on another rank"
            runners.pop(key, None)
            continue
        mem = res[key]["memory"]
        for k in ("state", "grads", "params"):  # per rank, the largest
            mem[k] = int(
                comm.all_reduce(torch.tensor([float(mem[k])], dtype=torch.float64), ctx.world, "max").item()
            )
    alive = [k for k, *_ in variants if k in runners]
    for key in alive:
        for i in range(args.warmup):
            runners[key].step(*data[i % len(data)])
        res[key]["times_ms"] = []
    for r in range(args.rounds):
        local: dict[str, list[float]] = {key: [] for key in alive}
        gc.collect()
        gc.disable()
        for s in range(args.steps):
            # Interleaved step by step, the order reversed every other step (A B B A ...): a
            # slow spell of the machine (seconds long on 2 shared cores) hits every variant alike.
            for key in alive if (r * args.steps + s) % 2 == 0 else alive[::-1]:
                comm.barrier(ctx.world)  # every rank starts the step together
                t0 = time.perf_counter()
                runners[key].step(*data[s % len(data)])
                local[key].append(time.perf_counter() - t0)
        gc.enable()
        for key in alive:
            # A step takes as long as its slowest rank; a round's value is its median step.
            slowest = comm.all_reduce(torch.tensor(local[key], dtype=torch.float64), ctx.world, "max")
            res[key]["times_ms"].append(statistics.median(slowest.tolist()) * 1e3)
        log(f"  {name}: round {r + 1}/{args.rounds} done")
    runners.clear()
    gc.collect()
    return {"variants": res, "rows": rows}


def worker(args_dict: dict, out_path: str) -> None:
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
            with open(out_path, "w") as f:
                json.dump(results, f)
    finally:
        ctx.close()


# ------------------------------------------------------------------------------ report
def _fmt_bytes(n: int) -> str:
    return f"{n / 2**20:8.3f} MiB"


def report(results: dict, args) -> tuple[list[dict], bool]:
    tokens = args.batch * args.seq_len
    rtol = RTOL[args.dtype]
    rows_out, mismatch = [], False
    print("\nloss check (global mean loss of steps 1 and 2; step 2 follows one AdamW update):")
    for name, cfg in results.items():
        for tag, ms_key, peer_key in cfg["rows"]:
            a, b = cfg["variants"][ms_key], cfg["variants"][peer_key]
            if a.get("error") or b.get("error"):
                print(f"  {tag:<20} {a['label']} vs {b['label']}: not compared (a variant failed)")
                continue
            diffs = [abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a["losses"], b["losses"])]
            bad = max(diffs) > rtol
            mismatch |= bad
            print(
                f"  {tag:<20} {a['label']:<26} {a['losses'][0]:.6f} {a['losses'][1]:.6f}   "
                f"{b['label']:<34} {b['losses'][0]:.6f} {b['losses'][1]:.6f}   "
                f"{'MISMATCH' if bad else 'ok'} (max rel diff {max(diffs):.1e}, tol {rtol:.0e})"
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
            row = {
                "config": tag,
                "meshspeed": a["label"],
                "peer": b["label"],
                "meshspeed_ms": None,
                "peer_ms": None,
                "ratio": None,
                "error": a.get("error") or b.get("error"),
            }
            ta, tb = a.get("times_ms"), b.get("times_ms")
            ms_txt = f"{statistics.median(ta):8.2f}" if ta else f"{'-':>8}"
            peer_txt = f"{statistics.median(tb):8.2f}" if tb else f"{'-':>8}"
            if ta:
                row["meshspeed_ms"] = statistics.median(ta)
                row["meshspeed_rounds_ms"] = ta
            if tb:
                row["peer_ms"] = statistics.median(tb)
                row["peer_rounds_ms"] = tb
            if ta and tb:
                ratios = [y / x for x, y in zip(ta, tb)]
                row["ratio"] = statistics.median(ratios)
                row["ratio_range"] = [min(ratios), max(ratios)]
                tail = (
                    f"{row['ratio']:15.2f} {f'{min(ratios):.2f}-{max(ratios):.2f}':>12} "
                    f"{tokens / row['meshspeed_ms'] * 1e3:9.0f} {tokens / row['peer_ms'] * 1e3:10.0f}"
                )
            else:
                tail = (
                    f"{'-':>15} {'-':>12} "
                    + (f"{tokens / row['meshspeed_ms'] * 1e3:9.0f}" if ta else f"{'-':>9}")
                    + f" {'-':>10}"
                )
            peer_label = b["label"] if not b.get("error") else f"{b['label']} FAILED"
            ms_label = a["label"] if not a.get("error") else f"{a['label']} FAILED"
            print(f"{tag:<18} {ms_label:<24} {ms_txt}   {peer_label:<36} {peer_txt} {tail}")
            for side in (a, b):
                if side.get("error"):
                    print(f"{'':<18}   ^ {side['label']}: {side['error']}")
            rows_out.append(row)
    print("ratio = peer / meshspeed step time (> 1: meshspeed faster); range: lowest-highest per-round ratio")
    print(
        "\ncounted bytes per rank (max over ranks), held between steps: storage of optimizer state, "
        "gradients, "
        f"parameters ({args.model}, {args.dtype})"
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
            rows_out.append(
                {
                    "config": dims,
                    "variant": v["label"],
                    "side": v["side"],
                    "state_bytes": m["state"],
                    "grad_bytes": m["grads"],
                    "param_bytes": m["params"],
                }
            )
    if mismatch:
        print(
            "\n(!) LOSS MISMATCH: a meshspeed variant and its peer computed different losses; "
            "their times are not comparable"
        )
    return rows_out, mismatch


def parse_args(argv):
    doc = __doc__.split("\n\n")
    p = argparse.ArgumentParser(
        description=doc[0], epilog="\n\n".join(doc[1:]), formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nproc", type=int, default=4, help="local gloo worker processes (default 4)")
    p.add_argument("--model", default="tiny", choices=preset_names(), help="model preset (default tiny)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES), help="compute dtype (default float32)")
    p.add_argument(
        "--batch", type=int, default=16, help="global batch in sequences, split over dp (default 16)"
    )
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument(
        "--steps",
        type=int,
        default=6,
        help="timed steps per variant per round; the round's value is their median (default 6)",
    )
    p.add_argument(
        "--rounds", type=int, default=8, help="interleaved rounds; the median is reported (default 8)"
    )
    p.add_argument(
        "--warmup", type=int, default=3, help="untimed steps per variant before the rounds (default 3)"
    )
    p.add_argument(
        "--tp",
        type=int,
        default=2,
        help="tensor-parallel degree of the tp configs (default 2; dp = nproc/tp)",
    )
    p.add_argument(
        "--bucket-mb", type=float, default=25.0, help="gradient bucket MiB, meshspeed and DDP (default 25)"
    )
    p.add_argument(
        "--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {','.join(CONFIGS)}"
    )
    p.add_argument(
        "--peer-adamw",
        default="fused",
        choices=["fused", "foreach", "for-loop"],
        help="torch AdamW implementation for the peers (default fused, torch's fastest)",
    )
    p.add_argument(
        "--fsdp-reshard-after-forward",
        type=lambda s: s.lower() in ("1", "true", "yes"),
        default=False,
        metavar="BOOL",
        help="FSDP2's reshard_after_forward (default false: ZeRO-2-like traffic; true: ZeRO-3)",
    )
    p.add_argument(
        "--loss-parallel",
        action="store_true",
        help="DTensor peer computes the loss with torch's loss_parallel() (vocab-parallel, like meshspeed) "
        "instead of cross-entropy on gathered logits",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--json", metavar="FILE", help="write the rows (timings, ratios, counted bytes, settings) here"
    )
    p.add_argument("--verbose", action="store_true", help="print tracebacks of variants that fail")
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in args.configs if c not in CONFIGS]
    if bad:
        p.error(f"--configs: unknown {', '.join(bad)}; valid: {', '.join(CONFIGS)}")
    for k in ("nproc", "batch", "seq_len", "steps", "rounds", "tp"):
        if getattr(args, k) < 1:
            p.error(f"--{k.replace('_', '-')}={getattr(args, k)} must be >= 1")
    if args.warmup < 0:
        p.error(f"--warmup={args.warmup} must be >= 0")
    if args.batch % args.nproc:
        p.error(
            f"--batch={args.batch} must be a multiple of --nproc={args.nproc} "
            "(each dp rank takes batch/dp rows)"
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
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        code = comm.spawn(worker, args.nproc, (vars(args), out))
        if code or not os.path.exists(out):
            print("train_step benchmark: the workers failed (see above)", file=sys.stderr)
            return code or 1
        with open(out) as f:
            results = json.load(f)
    rows, mismatch = report(results, args)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "settings": {k: v for k, v in vars(args).items() if k != "json"},
                    "torch": torch.__version__,
                    "loss_mismatch": mismatch,
                    "rows": rows,
                },
                f,
                indent=1,
            )
        print(f"rows written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
