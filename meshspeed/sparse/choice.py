"""Which products of a 2:4 layer run on sparse tensor cores: measured once per shape, never slower.

A SparseLinear's step runs, per micro-batch, y = x W~^T (forward) and dX = dY W~ (input
gradient), and once per optimizer step the preparation of what they read: the compressed W~
(forward), the compressed W~^T (input gradient) or the dense W~ = W * mask (a product left
dense). dW = dY^T X is always dense (the straight-through gradient is dense). At the first
forward of each distinct shape (out, in, tokens, dtype, bias) every one of those is timed once
(`measure`, a few milliseconds on the GPU) and `choose` takes the plan with the least time per
step among {both dense, forward sparse, input gradient sparse, both sparse}. A sparse plan must
beat the all-dense one by MARGIN so that timing noise leaves a tie on the plan without
compression in the step. `sparsity.kernels` forces either side ('sparse': every product that can
be; 'dense': none).

`choose` is a pure function of the timings, so it is tested on CPU with injected numbers.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

MODES = ("auto", "sparse", "dense")
MARGIN = 0.02  # a sparse plan must be 2% faster per step than dense-masked to be taken


@dataclasses.dataclass(frozen=True)
class ProductTimes:
    """Milliseconds, measured at one shape. Products per micro-batch; preparation per step."""

    dense_fwd: float  # F.linear(x, W~, b)
    sparse_fwd: float  # _cslt_sparse_mm(W~ compressed, x^T, b, transpose_result=True)
    dense_dgrad: float  # dY @ W~
    sparse_dgrad: float | None  # _cslt_sparse_mm(W~^T compressed, dY^T, transpose_result=True); None: no W~^T
    compress_w: float  # compress W~ alone
    compress_t: float | None  # compress W~^T alone
    compress_both: float | None  # both from one pass
    masked: float  # W~ = W * mask in the compute dtype (what a dense product reads)


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """Where a layer's products run, and why; `as_dict` is what meta.json records."""

    fwd: bool  # y = x W~^T on 2:4 kernels
    dgrad: bool  # dX = dY W~ on 2:4 kernels
    reason: str
    mode: str = "auto"
    times: ProductTimes | None = None
    alg_fwd: int = 0  # cuSPARSELt algorithm (from _cslt_sparse_mm_search) of each sparse product
    alg_dgrad: int = 0

    @property
    def any_sparse(self) -> bool:
        return self.fwd or self.dgrad

    def as_dict(self) -> dict:
        out = {
            "y": "sparse" if self.fwd else "dense",
            "dX": "sparse" if self.dgrad else "dense",
            "dW": "dense",
            "mode": self.mode,
            "reason": self.reason,
        }
        if self.times is not None:
            ms = dataclasses.asdict(self.times)
            out["ms"] = {k: None if v is None else round(v, 4) for k, v in ms.items()}
        return out


def prep_ms(t: ProductTimes, fwd: bool, dgrad: bool) -> float:
    """Per-step preparation of a plan: the compressed operands its sparse products read and the
    dense W~ its dense ones read."""
    if fwd and dgrad:
        return t.compress_both
    if fwd:
        return t.compress_w + t.masked
    if dgrad:
        return t.compress_t + t.masked
    return t.masked


def _plan_ms(t: ProductTimes, fwd: bool, dgrad: bool, uses: int) -> float:
    products = (t.sparse_fwd if fwd else t.dense_fwd) + (t.sparse_dgrad if dgrad else t.dense_dgrad)
    return uses * products + prep_ms(t, fwd, dgrad)


def choose(
    times: ProductTimes | None,
    mode: str,
    *,
    can_fwd: bool,
    can_dgrad: bool,
    uses_per_step: int = 1,
) -> KernelChoice:
    """The plan for one layer shape. `can_fwd` / `can_dgrad`: whether that product can run sparse
    at all (pattern, dtype, shape, transposable mask); `uses_per_step`: forwards per optimizer step
    (micro-batches), which share one preparation."""
    if mode not in MODES:
        raise ValueError(f"sparsity.kernels={mode!r}: choose one of {', '.join(MODES)}")
    can_dgrad = can_dgrad and can_fwd
    if mode == "dense" or not can_fwd:
        why = "sparsity.kernels=dense" if mode == "dense" else "no product can run on 2:4 kernels"
        return KernelChoice(False, False, why, mode, times)
    if mode == "sparse":
        why = "sparsity.kernels=sparse" + ("" if can_dgrad else "; dX dense (no W^T kernel)")
        return KernelChoice(True, can_dgrad, why, mode, times)
    if times is None:
        raise ValueError("sparsity.kernels=auto needs the measured product times")
    if times.sparse_dgrad is None or times.compress_t is None or times.compress_both is None:
        can_dgrad = False
    plans = [(f, d) for f in (False, True) for d in (False, True) if not (d and not can_dgrad)]
    cost = {p: _plan_ms(times, *p, max(1, uses_per_step)) for p in plans}
    dense = cost[(False, False)]
    best = min(plans, key=lambda p: (cost[p], sum(p)))  # a tie goes to fewer sparse products
    if best != (False, False) and cost[best] > dense * (1 - MARGIN):
        best = (False, False)
    t = times
    dx = "dX dense (no W^T kernel)"
    if can_dgrad:
        dx = f"dX 2:4 {t.sparse_dgrad:.3f} / dense {t.dense_dgrad:.3f}"
    why = (
        f"auto: y 2:4 {t.sparse_fwd:.3f} / dense {t.dense_fwd:.3f} ms, {dx} ms; "
        f"step {cost[best]:.3f} ms against {dense:.3f} dense-masked"
    )
    return KernelChoice(best[0], best[1], why, mode, times)


def time_ms(name: str, fn: Callable[[], object], device: torch.device, iters: int = 5, warmup: int = 2):
    """Median milliseconds of fn() (CUDA events on CUDA; wall clock elsewhere); `name` is the
    ProductTimes field, for timers injected by tests."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    samples.sort()
    return samples[len(samples) // 2]


def measure(
    ops,
    weight: torch.Tensor,
    mask: torch.Tensor,
    tokens: int,
    dtype: torch.dtype,
    bias: bool,
    can_dgrad: bool,
    timer: Callable = time_ms,
) -> tuple[ProductTimes, int, int]:
    """Time every product and preparation of one layer shape on random activations (the layer's
    own weight and mask): (times, searched forward algorithm, searched input-gradient algorithm).
    `timer(name, fn, device)` returns milliseconds."""
    out_f, in_f = weight.shape
    dev = weight.device
    with torch.no_grad():
        x = torch.randn(tokens, in_f, device=dev, dtype=dtype)
        g = torch.randn(tokens, out_f, device=dev, dtype=dtype)
        b = torch.randn(out_f, device=dev, dtype=dtype) if bias else None
        wm = weight.to(dtype) * mask
        both = ops.compress(weight, mask, dtype, want_w=True, want_t=can_dgrad)
        alg_f = ops.search(both.w, x.t(), b)
        alg_d = ops.search(both.wt, g.t(), None) if can_dgrad else 0

        def run(name: str, fn, when: bool = True):
            return timer(name, fn, dev) if when else None

        def compress(want_w: bool, want_t: bool):
            return lambda: ops.compress(weight, mask, dtype, want_w=want_w, want_t=want_t)

        times = ProductTimes(
            dense_fwd=run("dense_fwd", lambda: torch.nn.functional.linear(x, wm, b)),
            sparse_fwd=run("sparse_fwd", lambda: ops.mm(both.w, x.t(), b, alg_f)),
            dense_dgrad=run("dense_dgrad", lambda: g @ wm),
            sparse_dgrad=run("sparse_dgrad", lambda: ops.mm(both.wt, g.t(), None, alg_d), can_dgrad),
            compress_w=run("compress_w", compress(True, False)),
            compress_t=run("compress_t", compress(False, True), can_dgrad),
            compress_both=run("compress_both", compress(True, True), can_dgrad),
            masked=run("masked", lambda: weight.to(dtype) * mask),
        )
    return times, alg_f, alg_d


class Chooser:
    """One KernelChoice per distinct shape in this process, measured the first time it is asked."""

    def __init__(self, timer: Callable = time_ms) -> None:
        self.timer = timer
        self.choices: dict[tuple, KernelChoice] = {}

    def get(self, ops, weight, mask, *, tokens, dtype, bias, mode, can_fwd, can_dgrad, uses_per_step=1):
        key = (tuple(weight.shape), tokens, dtype, bias, mode, can_fwd, can_dgrad, uses_per_step, id(ops))
        if key not in self.choices:
            times, alg_f, alg_d = None, 0, 0
            if can_fwd and mode != "dense":
                # "sparse" still searches the algorithms; its times are recorded, not used
                times, alg_f, alg_d = measure(ops, weight, mask, tokens, dtype, bias, can_dgrad, self.timer)
            c = choose(times, mode, can_fwd=can_fwd, can_dgrad=can_dgrad, uses_per_step=uses_per_step)
            self.choices[key] = dataclasses.replace(c, alg_fwd=alg_f, alg_dgrad=alg_d)
        return self.choices[key]


CHOOSER = Chooser()


def kernel_choices(model: torch.nn.Module) -> dict[str, dict]:
    """{layer name: its choice as plain data} for every layer that has made one (meta.json)."""
    out = {}
    for fqn, mod in model.named_modules():
        c = getattr(mod, "kernel_choice", None)
        if isinstance(c, KernelChoice):
            out[getattr(mod, "name", "") or fqn] = c.as_dict()
    return out


def kernel_report(model: torch.nn.Module) -> str:
    """One line per layer that has chosen: where y, dX and dW run, and why."""
    rows = kernel_choices(model)
    if not rows:
        return ""
    width = max(len(n) for n in rows)
    lines = [f"{'2:4 kernels':<{width}}  y       dX      dW     why"]
    for name, c in rows.items():
        lines.append(f"{name:<{width}}  {c['y']:<7} {c['dX']:<7} {c['dW']:<6} {c['reason']}")
    return "\n".join(lines)
