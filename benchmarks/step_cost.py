"""A cost model of one training step, counted, not timed: FLOPs, bytes by class and kernel
launches of each side's step (benchmarks/step_cost_count.py's TorchDispatchMode), and the step
time they predict on an H100 and an H200 from a stated roofline.

    python -m benchmarks.step_cost                       # issue 24's 1.92B configuration, on meta
    python -m benchmarks.step_cost --device cpu --preset tiny --batch 2 --seq-len 64
    python -m benchmarks.step_cost --sides plain,autocast,eager --json out.json

Sides (one step each, after one step not counted, so that lazily made state is made):

  plain loop       bf16 parameters, torch.optim.AdamW(fused=True): trainer_overhead.py's plain side
  autocast loop    fp32 parameters, torch.autocast(bfloat16) forward, clip_grad_norm_(1.0) (foreach),
                   AdamW(fused=True): what the Hugging Face Trainer with bf16=True does (it clips
                   at max_grad_norm=1.0 by default)
  meshspeed eager  Trainer.train_step at one process, built as trainer_overhead.py builds it
  + fused kernels  --train.fused_kernels true with every Triton kernel chosen (on the meta device
                   nothing can be timed, so the chooser is not asked; each Triton kernel is one
                   launch reading its inputs and writing the outputs allocated for it)
  + zero-1, dp 2   one rank of --parallel.zero 1 at dp 2, modelled from the eager count: the
                   optimizer and the gradient norm over the rank's half, the gradient all-reduce
                   and the parameters' all-gather as communication buffers
  + 2:4            --sparsity.pattern 2:4 with every product cuSPARSELt can take sparse (on the meta
                   device as on an sm90 GPU: MetaCsltOps counts the mask-and-compress kernel and
                   the sparse products at half the dense FLOPs; the mask checks answer as on CUDA)

On the meta device the CUDA kernels are modelled where meta's would differ: ZeroAdamW's Triton
kernel (one launch per bucket), flash attention, autocast's casts (step_cost_count.py).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import subprocess
import sys
import tempfile

import torch

from benchmarks import harness, peers
from benchmarks.step_cost_count import (
    CLASSES,
    CudaLike,
    MetaCsltOps,
    StepCounter,
    TritonRecorder,
    adamw_kernel_bytes,
)
from meshspeed import comm, models

# ------------------------------------------------------------------------------ the roofline
# Peak dense bf16 tensor-core FLOP/s and HBM bandwidth: NVIDIA's H100 SXM and H200 datasheets
# (989.4 TFLOP/s dense bf16 both; 3.35 and 4.8 TB/s).
GPUS = {"H100": {"peak": 989.4e12, "hbm": 3.35e12}, "H200": {"peak": 989.4e12, "hbm": 4.8e12}}
# The achievable fractions, from the H200 measurements (docs/training-speed.md, torch 2.11):
# - matmuls: FLOP_FRACTION is fitted so that the plain loop's predicted step equals its
#   measured 83.8 ms on the H200 (the one calibration point; `--fit` prints the fit). The eager
#   profile's "matrix products 41.4 ms" is the check on it.
# - bytes: the eager profile's adamw_kernel moved 30 bytes × 1.92e9 parameters in 16.2 ms,
#   3.56 TB/s = 0.74 of the H200's 4.8 TB/s: every memory-bound kernel is taken at that fraction.
# - a launch: LAUNCH_S per kernel, the gap between two dependent kernels in an eager stream
#   (launch latency + tail; PyTorch eager measures ~2-4 µs on Hopper).
FLOP_FRACTION = 0.648
BYTE_FRACTION = 0.74
LAUNCH_S = 3e-6

# Measured on one H200, torch 2.11 (docs/training-speed.md; issue 40): step ms per side, and
# the eager profile's CUDA self time per step (the code before commit a2e4ffe).
MEASURED_H200 = {"plain loop": 83.8, "transformers": 82.7, "meshspeed eager": 104.8, "+ compile": 89.7}
MEASURED_PROFILE = {"adamw_kernel": 16.2, "gradient norm": 12.1, "copy_": 19.1, "fill_": 2.4}

SIDES = {
    "plain": "plain loop",
    "autocast": "autocast loop",
    "eager": "meshspeed eager",
    "fused": "+ fused kernels",
    "zero1": "+ zero-1, dp 2",
    "sparse": "+ 2:4",
}


def predict(ops, gpu: str, frac: float = FLOP_FRACTION) -> float:
    """Seconds: each operator at the slower of its FLOPs and its bytes, plus a launch cost."""
    g = GPUS[gpu]
    flop_rate, byte_rate = g["peak"] * frac, g["hbm"] * BYTE_FRACTION
    return sum(max(op.flops / flop_rate, op.bytes / byte_rate) + op.launches * LAUNCH_S for op in ops)


def fit_fraction(ops, measured_ms: float, gpu: str = "H200") -> float:
    """The FLOP_FRACTION at which `ops` take `measured_ms` (bisection; the time falls as it grows)."""
    lo, hi = 0.05, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if 1e3 * predict(ops, gpu, mid) > measured_ms else (lo, mid)
    return (lo + hi) / 2


# ------------------------------------------------------------------------------ the sides
class Shape:
    def __init__(self, args):
        over = {"n_layers": args.layers} if args.layers else {}
        if args.dim:
            over["dim"] = args.dim
        self.preset, self.over = args.preset, over
        self.mc = models.get_preset(args.preset, **over)
        self.batch, self.seq, self.device = args.batch, args.seq_len, args.device

    def data(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, self.mc.vocab_size, (self.batch, self.seq), generator=g)
        y = torch.randint(0, self.mc.vocab_size, (self.batch, self.seq), generator=g)
        return x.to(self.device), y.to(self.device)


@contextlib.contextmanager
def _fused_on(device):
    """torch's fused AdamW on the meta device (its kernel has a meta implementation; the
    optimizer's device check does not list meta)."""
    import torch.optim.adamw as adamw_mod
    import torch.optim.optimizer as opt_mod

    old = opt_mod._get_fused_kernels_supported_devices
    extra = ["meta"] if torch.device(device).type == "meta" else []
    patched = lambda: list(old()) + extra  # noqa: E731
    opt_mod._get_fused_kernels_supported_devices = patched
    had = getattr(adamw_mod, "_get_fused_kernels_supported_devices", None)
    if had is not None:
        adamw_mod._get_fused_kernels_supported_devices = patched
    try:
        yield
    finally:
        opt_mod._get_fused_kernels_supported_devices = old
        if had is not None:
            adamw_mod._get_fused_kernels_supported_devices = had


def _model(mc, device, dtype):
    """The single-device model; on the meta device built without its (data-writing) init."""
    if torch.device(device).type != "meta":
        return models.build_model(mc, seed=0, device=device, dtype=dtype)
    from meshspeed.models.registry import build_on_meta, recipe_for

    model = build_on_meta(recipe_for(mc))
    return model.to(dtype) if dtype is not None else model


def loop_side(shape: Shape, autocast: bool, counter: StepCounter):
    """The plain loop (bf16 parameters) or the autocast loop (fp32 parameters): one step fn."""
    dtype = torch.float32 if autocast else torch.bfloat16
    model = _model(shape.mc, shape.device, dtype)
    with _fused_on(shape.device):
        opt = peers.adamw(model, "fused")
    opt.step = counter.wrap(opt.step, "optimizer")
    x, y = shape.data()
    mode = CudaLike(flash=shape.device == "meta", autocast=autocast)
    clip = counter.wrap(torch.nn.utils.clip_grad_norm_, "gradient norm")

    def step():
        opt.zero_grad(set_to_none=True)
        with mode:
            loss = models.cross_entropy_loss(model(x), y)
        mode.forward_done()
        loss.backward()
        if autocast:  # the Hugging Face Trainer clips at max_grad_norm=1.0 by default (foreach)
            clip(model.parameters(), 1.0)
        with _fused_on(shape.device):
            opt.step()
        return loss.detach()

    return step


def trainer_side(shape: Shape, counter: StepCounter, ctx, extra: list, run_dir: str):
    """Trainer.train_step at one process, as benchmarks/trainer_overhead.py builds it; on the
    meta device its CUDA choices are modelled (ZeroAdamW's Triton kernel)."""
    from meshspeed.plan import config
    from meshspeed.plan.run_plan import make_plan
    from meshspeed.train import trainer as trainer_mod

    over = [
        ("model.preset", shape.preset),
        ("nproc", "1"),
        ("parallel.tp", "1"),
        ("train.seq_len", str(shape.seq)),
        ("train.global_batch_size", str(shape.batch)),
        ("train.micro_batch_size", str(shape.batch)),
        ("train.dtype", "bfloat16"),
        ("train.steps", "100000"),
        ("train.eval_interval", "0"),
        ("train.eval_batches", "1"),
        ("data.max_mb", "0.5"),
        ("run.dir", run_dir),
        ("run.device", "cpu"),
    ]
    over += [(f"model.{k}", str(v)) for k, v in shape.over.items()]
    cfg = config.load(None, over + extra)
    meta = shape.device == "meta"
    if meta:
        ctx = copy.copy(ctx)
        ctx.device = torch.device("meta")
    with _building(counter, meta):
        trainer = trainer_mod.Trainer(cfg, ctx, make_plan(cfg, 1))
    if meta:
        trainer.opt.impl = "triton"  # what impl="auto" resolves to on CUDA
        _sparse_kernels(trainer.model, counter)
        if getattr(trainer, "sparsity", None) is not None:
            trainer.sparsity.print_kernels = False  # its table says "sparse" for every layer here
    trainer.opt.step = counter.wrap(trainer.opt.step, "optimizer")
    mode = CudaLike(flash=meta)
    steps = iter(range(10**9))

    def step():
        with _regions(trainer_mod, counter), mode:
            return trainer.train_step(next(steps))

    step.trainer = trainer
    return step


@contextlib.contextmanager
def _building(counter: StepCounter, meta: bool):
    """The trainer built inside the counter, not recording, so that a host read of a meta tensor
    (`bool(mask.all())` as the 2:4 masks are installed) answers as the counter's `.item()` does;
    the 2:4 pattern check answers True (the masks are made 2:4: on CUDA it passes)."""
    if not meta:
        yield
        return
    from meshspeed.sparse import linear as sparse_linear

    saved = [(sparse_linear, n, getattr(sparse_linear, n)) for n in ("is_nm", "is_transposable_nm")]
    for mod, n, _ in saved:
        setattr(mod, n, lambda mask, n_, m_: True)
    old = counter.recording
    counter.recording = False
    try:
        with counter:
            yield
    finally:
        counter.recording = old
        for mod, n, fn in saved:
            setattr(mod, n, fn)


def _sparse_kernels(model, counter: StepCounter) -> None:
    """Every 2:4 layer on cuSPARSELt as on an sm90 GPU (MetaCsltOps counts its compression and
    products), its products forced sparse (sparsity.kernels=sparse: on meta nothing can be timed)."""
    from meshspeed.sparse.linear import SparseLinear

    for m in model.modules():
        if isinstance(m, SparseLinear):
            m.cslt_ops, m.kernel_mode = MetaCsltOps(counter), "sparse"


@contextlib.contextmanager
def _regions(trainer_mod, counter):
    """The trainer's gradient norm classed as such (the name the trainer module calls)."""
    old = trainer_mod.grad_norm
    trainer_mod.grad_norm = counter.wrap(old, "gradient norm")
    try:
        yield
    finally:
        trainer_mod.grad_norm = old


@contextlib.contextmanager
def _cuda_kernels(device, counter):
    """On the meta device: Triton kernels run as on CUDA, recorded (not run)."""
    if torch.device(device).type != "meta":
        yield
        return
    from meshspeed.kernels import adamw as adamw_mod
    from meshspeed.kernels import fused as fused_mod

    saved = [(adamw_mod, "triton_usable", adamw_mod.triton_usable),
             (fused_mod, "triton_usable", fused_mod.triton_usable),
             (torch.Tensor, "data_ptr", torch.Tensor.data_ptr)]  # fmt: skip
    real_ptr = torch.Tensor.data_ptr

    def data_ptr(t):  # every meta tensor's is 0: aliasing tests (is the master the parameters?) need one
        if t.device.type != "meta":
            return real_ptr(t)
        return t.untyped_storage()._cdata + t.storage_offset() * t.element_size()

    for mod, name, _ in saved[:2]:
        setattr(mod, name, lambda device: (True, ""))
    torch.Tensor.data_ptr = data_ptr
    try:
        with TritonRecorder(counter, {"adamw_kernel": adamw_kernel_bytes}):
            yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def count(step, counter: StepCounter, warm: int = 1) -> StepCounter:
    """One step counted after `warm` steps that are not."""
    with counter:
        counter.recording = False
        for _ in range(warm):
            step()
        counter.recording = True
        counter.clear()
        step()
    return counter


def zero1_model(eager: StepCounter, trainer, dp: int = 2) -> StepCounter:
    """One rank of ZeRO-1 at `dp`, from the eager count: the optimizer's and the gradient norm's
    operators over 1/dp of the elements (their launches unchanged: one kernel per bucket slice),
    the gradients all-reduced (fp32 buckets) and the parameters all-gathered (bf16 buckets):
    a ring moves 2(dp-1)/dp of an all-reduce's buffer and (dp-1)/dp of an all-gather's through
    HBM each way, read and written."""
    from benchmarks.step_cost_count import Op

    out = StepCounter("meta")
    for op in eager.ops:
        if op.cls in ("optimizer", "gradient norm"):
            op = Op(op.name, op.cls, op.read // dp, op.write // dp, op.flops, op.launches, op.phase)
        out.ops.append(op)
    for b in trainer.dp.buckets:
        g, p = b.grad.numel() * b.grad.element_size(), b.data.numel() * b.data.element_size()
        ar, ag = 2 * (dp - 1) * g // dp, (dp - 1) * p // dp
        out.ops.append(Op("all_reduce", "communication", ar, ar, 0, 1, "backward"))
        out.ops.append(Op("all_gather", "communication", ag, ag, 0, 1, "optimizer"))
    out.syncs = eager.syncs
    return out


def run_sides(args) -> dict:
    shape = Shape(args)
    ctx = comm.init(device="cpu")
    results, counters = {}, {}
    for key in args.sides:
        name = SIDES[key]
        counter = StepCounter(args.device)
        try:
            with tempfile.TemporaryDirectory() as d, _cuda_kernels(args.device, counter):
                if key in ("plain", "autocast"):
                    step = loop_side(shape, key == "autocast", counter)
                elif key == "zero1":
                    if "meshspeed eager" not in counters:
                        raise RuntimeError("needs the eager side (--sides ...,eager,zero1)")
                    c, tr = counters["meshspeed eager"]
                    counters[name] = (zero1_model(c, tr), tr)
                    continue
                else:
                    extra = {
                        "eager": [],
                        "fused": [("train.fused_kernels", "true")],
                        "sparse": [("sparsity.pattern", "2:4")],
                    }[key]
                    step = trainer_side(shape, counter, ctx, extra, d)
                    if key == "fused" and args.device == "meta":
                        _all_triton(step.trainer.model)
                count(step, counter)
                counters[name] = (counter, getattr(step, "trainer", None))
        except Exception as err:  # noqa: BLE001 - a side that cannot be counted is a row saying why
            results[name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:150]}"}
    for name, (c, _) in counters.items():
        r = c.totals()
        r["predicted_ms"] = {g: 1e3 * predict(c.ops, g) for g in GPUS}
        r["top"] = sorted(c.by_op().items(), key=lambda kv: -kv[1]["bytes"])[:12]
        results[name] = r
    results = {SIDES[k]: results[SIDES[k]] for k in args.sides if SIDES[k] in results}
    return {"config": _describe(shape), "device": args.device, "sides": results, "ops": counters}


def _all_triton(model) -> None:
    """--train.fused_kernels with Triton everywhere it exists (the chooser times on CUDA; here
    nothing runs)."""
    from meshspeed.models.layers import set_fused_kernels

    set_fused_kernels(model)


def _describe(shape: Shape) -> str:
    n = sum(p.numel() for p in _model(shape.mc, "meta", None).parameters())
    return f"{shape.preset} {shape.over or ''} {shape.batch} x {shape.seq} tokens, {n / 1e9:.2f}B parameters"


# ------------------------------------------------------------------------------ printing
SHORT = {
    "matmul/attention": "matmul",
    "forward elementwise": "fwd ew",
    "backward elementwise": "bwd ew",
    "casts and copies": "copies",
    "fills": "fills",
    "optimizer": "optim",
    "gradient norm": "norm",
    "communication": "comm",
}


def print_table(res: dict) -> None:
    print(f"\nstep cost, {res['config']}, counted on {res['device']} (GB = 1e9 bytes):")
    head = f"  {'side':<18} {'TFLOP':>7} " + " ".join(f"{SHORT[c]:>7}" for c in CLASSES)
    print(head + f" {'non-mm':>7} {'launch':>7} {'syncs':>5} {'H100 ms':>8} {'H200 ms':>8}")
    for name, r in res["sides"].items():
        if "error" in r:
            print(f"  {name:<18} not counted: {r['error']}")
            continue
        by = r["by_class"]
        cells = " ".join(f"{by.get(c, 0) / 1e9:>7.2f}" for c in CLASSES)
        rest = (r["bytes"] - by["matmul/attention"]) / 1e9
        p = r["predicted_ms"]
        print(
            f"  {name:<18} {r['flops'] / 1e12:>7.2f} {cells} {rest:>7.2f} {r['launches']:>7} "
            f"{r['syncs']:>5} {p['H100']:>8.1f} {p['H200']:>8.1f}"
        )


def print_targets(res: dict) -> None:
    s = res["sides"]
    a, e, p = s.get("autocast loop"), s.get("meshspeed eager"), s.get("plain loop")
    if not (a and e and "error" not in a and "error" not in e):
        return
    mm = "matmul/attention"
    ea, ee = a["bytes"] - a["by_class"][mm], e["bytes"] - e["by_class"][mm]
    print("\nissue 40 item 2, against the autocast loop:")
    print(f"  bytes outside matmul/attention: {ee / ea:.3f} x (target <= 1.05)")
    print(f"  launches: {e['launches'] / a['launches']:.3f} x (target <= 1.1)")
    for g in GPUS:
        x = e["predicted_ms"][g] / a["predicted_ms"][g]
        line = f"  predicted step on the {g}: {x:.3f} x the autocast loop (target <= 1.0)"
        if p and "error" not in p:
            line += f", {e['predicted_ms'][g] / p['predicted_ms'][g]:.3f} x the plain loop (<= 1.1)"
        print(line)
    for name, r in s.items():
        if name.startswith("+") and "error" not in r:
            extra = (r["bytes"] - r["by_class"][mm]) - ee
            print(f"  {name}: {extra / 1e9:+.2f} GB outside matmul/attention, "
                  f"{r['launches'] - e['launches']:+d} launches against eager")  # fmt: skip


def print_validation(res: dict, parent: dict | None) -> None:
    print("\nagainst the H200 (torch 2.11; docs/training-speed.md), predicted vs measured step ms:")
    rows = [("plain loop", res["sides"].get("plain loop"), "calibration point")]
    if parent:
        rows.append(("meshspeed eager", parent.get("meshspeed eager"), "code before a2e4ffe, as measured"))
    rows.append(("meshspeed eager", res["sides"].get("meshspeed eager"), "this tree (not measured yet)"))
    for name, r, note in rows:
        if not r or "error" in r:
            continue
        pred, meas = r["predicted_ms"]["H200"], MEASURED_H200[name]
        print(f"  {name:<18} {pred:>7.1f} {meas:>7.1f}  {100 * (pred - meas) / meas:+6.1f}%  {note}")
    if res.get("fit"):
        print(
            f"  (the plain loop's ops take the measured 83.8 ms at FLOP_FRACTION {res['fit']:.3f}; "
            f"the model uses {FLOP_FRACTION})"
        )
    if parent and "meshspeed eager" in parent and "error" not in parent["meshspeed eager"]:
        print("  the eager profile's classes (code before a2e4ffe, CUDA self time per step):")
        for key, ms in parent.get("profile", {}).items():
            meas = MEASURED_PROFILE[key]
            print(f"    {key:<16} {ms:>7.1f} {meas:>7.1f}  {100 * (ms - meas) / meas:+6.1f}%")


def profile_classes(ops, gpu: str = "H200") -> dict:
    """Predicted ms of the kernels the H200 profile named: the optimizer kernel, the gradient
    norm, copy_ (casts and copies) and fill_."""
    out = dict.fromkeys(MEASURED_PROFILE, 0.0)
    g = GPUS[gpu]
    for op in ops:
        t = 1e3 * (max(op.flops / (g["peak"] * FLOP_FRACTION), op.bytes / (g["hbm"] * BYTE_FRACTION)))
        t += 1e3 * op.launches * LAUNCH_S
        if op.name == "triton:adamw_kernel":
            out["adamw_kernel"] += t
        elif op.cls == "gradient norm":
            out["gradient norm"] += t
        elif op.name in ("copy_", "_to_copy"):
            out["copy_"] += t
        elif op.name in ("fill_", "zero_"):
            out["fill_"] += t
    return out


def count_parent(argv: list[str], commit: str = "a2e4ffe^") -> dict | None:
    """The eager side counted on `commit`'s meshspeed (a scratch `git archive` of it): the code
    the H200 figures measured."""
    root = harness.ROOT
    with tempfile.TemporaryDirectory() as d:
        arch = subprocess.run(["git", "-C", root, "archive", commit, "meshspeed", "configs"],
                              capture_output=True, check=False)  # fmt: skip
        if arch.returncode:
            print(f"  (the parent commit could not be read: {arch.stderr.decode()[:200]})")
            return None
        subprocess.run(["tar", "-x", "-C", d], input=arch.stdout, check=True)
        os.symlink(os.path.join(root, "benchmarks"), os.path.join(d, "benchmarks"))
        out = os.path.join(d, "parent.json")
        env = {**os.environ, "PYTHONPATH": d}
        cmd = [sys.executable, "-m", "benchmarks.step_cost", *argv, "--sides", "eager", "--json", out,
               "--parent", "none", "--quiet"]  # fmt: skip
        p = subprocess.run(cmd, cwd=d, env=env, capture_output=True, text=True, check=False)
        if p.returncode or not os.path.exists(out):
            print(f"  (counting {commit} failed: {p.stderr.strip().splitlines()[-1:] or p.returncode})")
            return None
        with open(out) as f:
            data = json.load(f)
    return data["sides"]


def main(argv=None) -> dict:
    p = harness.parser(__doc__)
    p.add_argument("--device", default="meta", choices=("meta", "cpu"))
    p.add_argument("--preset", default="llama3-8b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=0)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--sides", default="plain,autocast,eager,fused,zero1,sparse")
    p.add_argument("--parent", default="a2e4ffe^", help="also count eager at this commit ('none': not)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    args.sides = [s for s in args.sides.split(",") if s]
    if bad := [s for s in args.sides if s not in SIDES]:
        p.error(f"--sides {','.join(bad)}: choose among {', '.join(SIDES)}")
    res = run_sides(args)
    parent = None
    if args.parent != "none":
        size = ["--device", args.device, "--preset", args.preset, "--layers", str(args.layers), "--dim",
                str(args.dim), "--batch", str(args.batch), "--seq-len", str(args.seq_len)]  # fmt: skip
        parent = count_parent(size, args.parent)
    if parent and "meshspeed eager" in parent:
        parent["profile"] = parent["meshspeed eager"].get("profile", {})
    for name, (c, _) in res["ops"].items():
        if name in res["sides"] and "error" not in res["sides"][name]:
            res["sides"][name]["profile"] = profile_classes(c.ops)
    if "plain loop" in res["ops"] and args.device == "meta" and parent is not False:
        res["fit"] = fit_fraction(res["ops"]["plain loop"][0].ops, MEASURED_H200["plain loop"])
    if not args.quiet:
        print_table(res)
        print_targets(res)
        if (args.preset, args.layers, args.dim, args.batch, args.seq_len) == ("llama3-8b", 4, 0, 2, 2048):
            print_validation(res, parent)  # the H200 figures are of this configuration only
    out = {"config": res["config"], "device": res["device"], "sides": res["sides"], "parent": parent}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return out


if __name__ == "__main__":
    main()
