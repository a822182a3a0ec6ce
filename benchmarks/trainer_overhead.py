"""The trainer against a hand-written loop on one device: what meshspeed's bookkeeping costs.

Side by side in one process, on the same model and batch, steps interleaved (A B C ... C B A)
so that a slow spell of a shared machine hits every side alike:

  plain loop      the model's parameters in train.dtype, torch.optim.AdamW(fused=True)
  transformers    LlamaForCausalLM (sdpa) of the same config, the same loop
  meshspeed       Trainer.train_step: fp32 gradient buckets and masters, grad norm + clip,
                  ZeroAdamW (one kernel per bucket); then --train.fused_kernels true and
                  --train.compile true (a row saying "not available" where the setting is not)

Per side: step ms (median over rounds of each round's median), tokens/s, MFU (with a known or
--peak-tflops peak), peak memory (CUDA: the allocator's peak over one step; CPU: the training
state's counted bytes plus the step's transient peak from torch.profiler's allocation events),
optimizer-step ms and the operators (CPU) or kernels (CUDA) one optimizer step launches, counted
with torch.profiler. Then the optimizer alone on the same float32 parameters: torch's fused
AdamW against ZeroAdamW's kernel and its per-term reference, and the bf16 ZeroAdamW.

    python -m benchmarks.trainer_overhead                          # CPU: tiny and small, fp32, bf16
    python -m benchmarks.trainer_overhead --presets small --dtypes float32 --rounds 3
    python -m benchmarks.trainer_overhead --device cuda --presets llama3-8b --layers 4 \\
        --dim 2048 --seq-len 2048 --batch 2 --dtypes bfloat16   # issue 24's 1.92B configuration
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import statistics
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

# kineto prints `USDT: ... profiler_start` / `profiler_stop` at every profiler start and stop (87
# lines a run: the peak-memory and launch counts profile each side); above its top level it is
# quiet. Read at the first profiler start, so setting it here is in time; a user's value wins.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

from benchmarks import harness, peers
from meshspeed import comm, models
from meshspeed.comm.launch import headline
from meshspeed.memory import cpu_peak_bytes
from meshspeed.models.flops import flops_per_token
from meshspeed.train.compile_stats import compile_stats

CPU_SHAPES = {"tiny": (8, 128), "small": (4, 256)}  # preset: (batch, seq_len) of the CPU default
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel")  # prefixes: the Ex variants count too
SIDES = {  # a row's name: its short name for --sides and --profile
    "plain loop": "plain",
    "transformers": "transformers",
    "meshspeed eager": "eager",
    "+ fused kernels": "fused",
    "+ compile": "compile",
}


# ------------------------------------------------------------------------------ measuring
def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def launched(step, batch, opt, device) -> int:
    """Operators (CPU: the profiler's top-level aten operators) or kernels (CUDA: kernel
    launches) inside `opt`'s step() during one real training step `step(*batch)`."""
    cuda = torch.device(device).type == "cuda"
    inner = opt.step

    def marked(*a, **k):
        with record_function("__optimizer_step__"):
            return inner(*a, **k)

    opt.step = marked
    try:
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            step(*batch)
            _sync(device)
    finally:
        opt.step = inner
    events = prof.events()
    roots = [e for e in events if e.name == "__optimizer_step__"]

    def under(e) -> bool:
        while e.cpu_parent is not None:
            if e.cpu_parent in roots:
                return True
            e = e.cpu_parent
        return False

    def top_level(e) -> bool:  # an aten operator no other aten operator called
        while e.cpu_parent is not None and e.cpu_parent not in roots:
            e = e.cpu_parent
            if e.name.startswith("aten::"):
                return False
        return e.cpu_parent in roots

    if cuda:
        # runtime launch calls: ATen's cudaLaunchKernel(ExC), Triton's cuLaunchKernel(Ex)
        return sum(1 for e in events if e.name.startswith(LAUNCHES) and under(e))
    return sum(1 for e in events if e.name.startswith("aten::") and top_level(e))


class Timed:
    """Wraps an optimizer's step() to time each call (synchronised on CUDA)."""

    def __init__(self, opt, device):
        self.inner, self.device, self.ms = opt.step, device, []

        def step(*a, **k):
            _sync(device)
            t0 = time.perf_counter()
            out = self.inner(*a, **k)
            _sync(device)
            self.ms.append((time.perf_counter() - t0) * 1e3)
            return out

        opt.step = step


# ------------------------------------------------------------------------------ the sides
class Env:
    """The command line plus what is made of it once (the process group, the device's peak)."""

    def __init__(self, args, ctx, peak):
        self.__dict__.update(vars(args))
        self.ctx, self.peak = ctx, peak

    def shape(self, preset: str) -> tuple[int, int]:
        batch, seq = CPU_SHAPES.get(preset, (2, 2048))
        return self.batch or batch, self.seq_len or seq

    def model_overrides(self) -> dict:
        return {k: v for k, v in (("n_layers", self.layers), ("dim", self.dim)) if v}


def _trainer(args, preset: str, dtype: str, extra: list, run_dir: str):
    from meshspeed.plan import config
    from meshspeed.plan.run_plan import make_plan
    from meshspeed.train.trainer import Trainer

    batch, seq = args.shape(preset)
    over = [
        ("model.preset", preset),
        ("nproc", "1"),
        ("parallel.tp", "1"),
        ("train.seq_len", str(seq)),
        ("train.global_batch_size", str(batch)),
        ("train.micro_batch_size", str(batch)),
        ("train.dtype", dtype),
        ("train.steps", "100000"),
        ("train.eval_interval", "0"),
        ("train.eval_batches", "1"),  # the final evaluation: seq_len 2048 leaves few validation batches
        ("data.max_mb", "0.5"),
        ("run.dir", run_dir),
    ]
    over += [(f"model.{k}", str(v)) for k, v in args.model_overrides().items()]
    if "device" in {f.name for f in dataclasses.fields(config.RunSection)}:
        over.append(("run.device", args.device))
    cfg = config.load(None, over + extra)
    trainer = Trainer(cfg, args.ctx, make_plan(cfg, 1))
    counter = iter(range(10**9))
    return trainer, (lambda x, y: trainer.train_step(next(counter)))


def _plain(model, dtype, device):
    model = model.to(device=device, dtype=harness.DTYPES[dtype])
    opt = peers.adamw(model, "fused")

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = models.cross_entropy_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return model, opt, step


def _transformers(model_config, dtype, device):
    import transformers

    from meshspeed.models.hf import config_to_hf

    hf = {k: v for k, v in config_to_hf(model_config).items() if k not in ("architectures", "model_type")}
    hf.pop("torch_dtype", None)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf, attn_implementation="sdpa"))
    model = model.to(device=device, dtype=harness.DTYPES[dtype])
    opt = peers.adamw(model, "fused")

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = models.cross_entropy_loss(model(input_ids=x, use_cache=False).logits, y)
        loss.backward()
        opt.step()
        return loss.detach()

    return model, opt, step


def compare(args, preset: str, dtype: str) -> list[dict]:
    """The table's rows for one preset and dtype."""
    batch, seq = args.shape(preset)
    rows, sides, timers, probes = [], {}, {}, {}
    with contextlib.ExitStack() as stack:
        trainers = {}
        variants = [("meshspeed eager", []), ("+ fused kernels", [("train.fused_kernels", "true")])]
        from meshspeed.plan import config

        fields = {f.name for f in dataclasses.fields(config.TrainSection)}
        compiled = [("train.compile", "true")] if "compile" in fields else None
        variants.append(("+ compile", compiled))
        variants = [(n, e) for n, e in variants if SIDES[n] in args.sides]
        for name, extra in variants:
            if extra is None:
                rows.append({"side": name, "error": "not available (no train.compile setting)"})
                continue
            try:
                d = stack.enter_context(tempfile.TemporaryDirectory())
                trainer, step = _trainer(args, preset, dtype, extra, d)
            except Exception as err:  # noqa: BLE001 - a failed setting is a row saying why
                rows.append({"side": name, "error": headline(err)})
                continue
            trainers[name] = trainer
            sides[name], timers[name] = step, Timed(trainer.opt, args.device)
            probes[name] = trainer.opt
        mc = next(iter(trainers.values())).model_config if trainers else None
        if mc is None:
            return rows
        if "plain" in args.sides:
            base = models.build_model(mc, seed=0)
            plain_model, plain_opt, sides["plain loop"] = _plain(base, dtype, args.device)
            timers["plain loop"], probes["plain loop"] = Timed(plain_opt, args.device), plain_opt
        try:
            if "transformers" in args.sides:
                hf_model, hf_opt, sides["transformers"] = _transformers(mc, dtype, args.device)
                timers["transformers"], probes["transformers"] = Timed(hf_opt, args.device), hf_opt
        except Exception as err:  # noqa: BLE001
            rows.append({"side": "transformers", "error": headline(err)})
        order = ["plain loop", "transformers"] + [n for n in sides if n not in ("plain loop", "transformers")]
        order = [n for n in order if n in sides]
        data = harness.token_batches(1, mc.vocab_size, batch, seq, 0, 1, n=args.steps)
        data = [(x.to(args.device), y.to(args.device)) for x, y in data]

        def timed_side(fn):
            def run(x, y):
                out = fn(x, y)
                _sync(args.device)
                return out

            return run

        dynamo = {}  # side -> graph breaks and recompiles (train/compile_stats.py)
        for name in order:  # warm-up (and compilation) outside the clock
            before = compile_stats()
            for i in range(2):
                sides[name](*data[i % len(data)])
            dynamo[name] = compile_stats() - before
            timers[name].ms.clear()
        before = compile_stats()
        rounds = harness.interleaved_rounds(
            args.ctx, {n: timed_side(sides[n]) for n in order}, lambda i: data[i], args.rounds, args.steps
        )
        if "+ compile" in dynamo:  # only the compiled side can compile while timed
            dynamo["+ compile"] = dynamo["+ compile"] + (compile_stats() - before)
        flops = flops_per_token(mc, seq)
        for name in order:
            ms = statistics.median(rounds[name])
            row = {"side": name, "step_ms": ms, "tokens_per_s": batch * seq / ms * 1e3}
            row["mfu"] = row["tokens_per_s"] * flops / args.peak if args.peak else None
            row["opt_ms"] = statistics.median(timers[name].ms) if timers[name].ms else None
            row["opt_ops"] = launched(sides[name], data[0], probes[name], args.device)
            if name in trainers:
                row["buckets"] = len(trainers[name].dp.buckets)
            row["peak_mb"] = peak_memory(args, sides[name], data[0], trainers.get(name), probes[name]) / 2**20
            row["dynamo"] = dataclasses.asdict(dynamo[name])  # for --json
            rows.append(row)
        for name in order:
            if SIDES[name] in args.profile:
                kernels(args, name, sides[name], data)
    gc.collect()
    return rows


def kernels(args, name, step, data, rows: int = 18) -> None:
    """Where one side's step time goes: two steps under torch.profiler, the operators (CPU) or
    kernels (CUDA) by self time."""
    cuda = torch.device(args.device).type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for i in range(2):
            step(*data[i % len(data)])
            _sync(args.device)
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(f"\n{name}: two steps under torch.profiler, by {key}:")
    print(prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=56))


def peak_memory(args, step, batch, trainer, opt) -> int:
    """Bytes at the step's peak: the allocator's on CUDA; on the CPU the training state's
    counted storages (parameters, gradients, optimizer state) plus the step's transient peak."""
    if torch.device(args.device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step(*batch)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    if trainer is not None:
        dp = trainer.dp
        held = harness.storage_bytes([b.data for b in dp.buckets])
        held += dp.grad_bytes() + trainer.opt.state_bytes()
    else:
        params = [p for g in opt.param_groups for p in g["params"]]
        held = harness.storage_bytes(params) + harness.storage_bytes(peers.optimizer_state(opt))
    return held + cpu_peak_bytes(lambda: step(*batch))


# ------------------------------------------------------------------------------ the optimizer alone
def optimizer_alone(args, preset: str) -> list[dict]:
    """torch's fused AdamW against ZeroAdamW on the same float32 parameters (and bf16 ones), the
    gradients set once: the step alone, interleaved."""
    from meshspeed.parallel.optim import build_data_parallel

    mc = models.get_preset(preset, **args.model_overrides())
    mesh = comm.ParallelDims().build(args.ctx)
    g = torch.Generator().manual_seed(0)
    sides, opts = {}, {}
    ref = models.build_model(mc, seed=0).to(args.device)
    torch_opt = peers.adamw(ref, "fused")
    for p in ref.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(args.device)
    sides["torch fused AdamW (fp32)"], opts["torch fused AdamW (fp32)"] = torch_opt.step, None
    for label, impl, dtype in (
        ("ZeroAdamW fp32", "auto", torch.float32),
        ("ZeroAdamW fp32, per-term reference", "reference", torch.float32),
        ("ZeroAdamW bf16 (fp32 masters)", "auto", torch.bfloat16),
    ):
        model = models.build_model(mc, seed=0).to(args.device)
        dp, opt = build_data_parallel(
            model, mesh, dtype=dtype, lr=harness.LR, betas=harness.BETAS, eps=harness.EPS,
            weight_decay=harness.WD, impl=impl,
        )  # fmt: skip
        for b in dp.buckets:
            b.grad.normal_(generator=g) if args.device == "cpu" else b.grad.normal_()
        sides[label], opts[label] = opt.step, (dp, opt)
    for fn in sides.values():
        fn()
    rounds = harness.interleaved_rounds(
        args.ctx, {k: (lambda fn=fn: (fn(), _sync(args.device))) for k, fn in sides.items()},
        lambda i: (), args.rounds, max(args.steps, 5),
    )  # fmt: skip
    base = statistics.median(rounds["torch fused AdamW (fp32)"])
    rows = []
    for label, fn in sides.items():
        ms = statistics.median(rounds[label])
        holder = opts[label][1] if opts[label] else torch_opt
        ops = launched(lambda: holder.step(), (), holder, args.device)
        buckets = len(opts[label][0].buckets) if opts[label] else None
        rows.append({"side": label, "opt_ms": ms, "vs_torch": ms / base, "opt_ops": ops, "buckets": buckets})
    for dp, _ in (v for v in opts.values() if v):
        dp.remove_hooks()
    return rows


# ------------------------------------------------------------------------------ printing
def _fmt(v, spec: str, none: str = "n/a") -> str:
    return none if v is None else format(v, spec)


def print_table(preset, dtype, rows) -> None:
    print(f"\n{preset}, {dtype}:")
    print(f"  {'side':<18} {'step ms':>9} {'x plain':>8} {'tokens/s':>10} {'MFU':>6} {'peak MB':>9} "
          f"{'opt ms':>8} {'opt ops':>8} {'ops/bucket':>10}")  # fmt: skip
    plain = next((r["step_ms"] for r in rows if r["side"] == "plain loop" and "step_ms" in r), None)
    for r in rows:
        if "error" in r:
            print(f"  {r['side']:<18} {r['error']}")
            continue
        per = r["opt_ops"] / r["buckets"] if r.get("buckets") else None
        print(
            f"  {r['side']:<18} {r['step_ms']:>9.1f} {_fmt(plain and r['step_ms'] / plain, '>8.3f')} "
            f"{r['tokens_per_s']:>10,.0f} {_fmt(r['mfu'] and 100 * r['mfu'], '>5.1f'):>6} "
            f"{r['peak_mb']:>9.1f} {_fmt(r['opt_ms'], '>8.2f')} {r['opt_ops']:>8} {_fmt(per, '>10.1f'):>10}"
        )
    compiled = [
        f"{r['side']}: graph breaks {r['dynamo']['graph_breaks']}, recompiles {r['dynamo']['recompiles']}"
        for r in rows
        if "dynamo" in r
    ]
    if compiled:  # per side, warm-up and timed steps: train.compile's blocks should not break
        print("  dynamo: " + "; ".join(compiled))


def print_optimizer(preset, rows) -> None:
    print(f"\n{preset}: the optimizer step alone (same parameters, gradients set once):")
    print(f"  {'side':<36} {'ms':>8} {'x torch':>8} {'ops':>6} {'ops/bucket':>10}")
    for r in rows:
        per = r["opt_ops"] / r["buckets"] if r["buckets"] else None
        ms, x = f"{r['opt_ms']:>8.2f}", f"{r['vs_torch']:>8.3f}"
        print(f"  {r['side']:<36} {ms} {x} {r['opt_ops']:>6} {_fmt(per, '>10.1f'):>10}")


def acceptance(results, alone) -> None:
    print("\nissue 24's acceptance:")
    for (preset, dtype), rows in results.items():
        by = {r["side"]: r for r in rows if "step_ms" in r}
        if dtype == "float32" and "plain loop" in by and "meshspeed eager" in by:
            x = by["meshspeed eager"]["step_ms"] / by["plain loop"]["step_ms"]
            print(f"  {preset}: float32 trainer step / plain loop = {x:.3f} (target <= 1.05)")
        if dtype == "bfloat16" and "meshspeed eager" in by:
            r = by["meshspeed eager"]
            per = r["opt_ops"] / r["buckets"]
            print(f"  {preset}: bf16 optimizer step, {per:.1f} operators per bucket (target <= 8)")
        if "plain loop" in by and "meshspeed eager" in by and by["plain loop"].get("mfu"):  # GPU acceptance
            x = by["plain loop"]["step_ms"] / by["meshspeed eager"]["step_ms"]
            print(f"  {preset}, {dtype}: trainer eager speed / plain loop = {x:.3f} (GPU target >= 0.9)")
        if by.get("+ compile", {}).get("mfu"):
            mfu = 100 * by["+ compile"]["mfu"]
            print(f"  {preset}, {dtype}: --train.compile MFU {mfu:.1f}% (GPU target >= 50%)")
    for preset, rows in alone.items():
        for r in rows:
            if r["side"].startswith("ZeroAdamW") and "reference" not in r["side"]:  # the kernels
                print(f"  {preset}: {r['side']} step / torch fused AdamW = {r['vs_torch']:.3f} (target <= 1)")


def main(argv=None) -> None:
    p = harness.parser(__doc__)
    p.add_argument("--presets", default="tiny,small")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=0, help="rows per step (0: the preset's CPU default)")
    p.add_argument("--seq-len", type=int, default=0, help="tokens per row (0: the preset's CPU default)")
    p.add_argument("--layers", type=int, default=0, help="model.n_layers override")
    p.add_argument("--dim", type=int, default=0, help="model.dim override")
    p.add_argument("--steps", type=int, default=5, help="timed steps per round (the median is taken)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--peak-tflops", type=float, default=0.0, help="the device's peak for MFU (0: known GPUs)")
    p.add_argument(
        "--sides",
        default=",".join(SIDES.values()),
        help=f"which sides to run, comma-separated among {', '.join(SIDES.values())} (default all; "
        "at 1.92B parameters all five do not fit one 141 GB GPU together)",
    )
    p.add_argument("--profile", default="", help="sides whose two steps are profiled, printed by self time")
    p.add_argument(
        "--optimizer-alone",
        default="true",
        choices=("true", "false"),
        help="also time the optimizer alone on the same parameters (default true)",
    )
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    harness.require_positive(p, args, "steps", "rounds")
    for flag, valid in (("presets", models.preset_names()), ("dtypes", ("float32", "bfloat16", "float16"))):
        if bad := [v for v in getattr(args, flag).split(",") if v not in valid]:
            p.error(f"--{flag} {','.join(bad)}: choose among {', '.join(valid)}")
    for flag in ("sides", "profile"):
        chosen = [s for s in getattr(args, flag).split(",") if s]
        if bad := [s for s in chosen if s not in SIDES.values()]:
            p.error(f"--{flag} {','.join(bad)}: choose among {', '.join(SIDES.values())}")
        setattr(args, flag, chosen)
    if not set(args.sides) - {"plain", "transformers"}:
        p.error(f"--sides {','.join(args.sides)}: name at least one meshspeed side (eager, fused, compile)")
    from meshspeed.train.metrics import peak_flops

    env = Env(args, comm.init(device=args.device), peak_flops(args.device, 1, args.peak_tflops or None))
    torch.manual_seed(0)
    results, alone = {}, {}
    for preset in args.presets.split(","):
        for dtype in args.dtypes.split(","):
            what = f"{args.rounds} round(s) of {args.steps} step(s) per side"
            print(f"timing {preset}, {dtype}: {what} ...", flush=True)
            results[(preset, dtype)] = rows = compare(env, preset, dtype)
            print_table(preset, dtype, rows)
        if args.optimizer_alone == "true":
            alone[preset] = optimizer_alone(env, preset)
            print_optimizer(preset, alone[preset])
    acceptance(results, alone)
    if args.json:
        table = {f"{k[0]}/{k[1]}": v for k, v in results.items()}
        harness.write_json(args.json, "trainer_overhead", args, results=table, optimizer=alone)


if __name__ == "__main__":
    main()
