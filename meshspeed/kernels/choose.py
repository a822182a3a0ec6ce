"""Pick, per operation and shape, the fastest of its equivalent implementations, by timing
each once (forward + backward) and keeping the answer: turning fused kernels on never makes a
run slower than the reference, whatever the device or the shape.

    chooser = KernelChooser(device, agree=...)
    chooser.pick("rms_norm", (tokens, dim), torch.bfloat16)  -> "ref" | "triton"

Operations and their implementations (every one with the reference's signature):

    rms_norm       (tokens, dim)                                 ref, triton
    add_rms_norm   (tokens, dim)                                 ref, triton
    swiglu         (tokens, hidden)                              ref, triton
    rope           (batch, seq, heads, kv_heads, head_dim)       ref, complex, triton
    linear_ce      (tokens, dim, vocab)                          ref, torch, triton

A candidate replaces the reference only when its median time is below the reference's by more
than `margin` (timings are noisy; a tie keeps the reference). Triton candidates enter only where
Triton runs (CUDA, or TRITON_INTERPRET=1). `agree(times)` makes ranks that compute the same
replicated values (a tensor-parallel group) take the same decision: every rank times, the
times are reduced (max), and all pick from the same numbers. The timer is injectable, so the
choice logic is tested with made-up timings.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

import torch

from .add_norm import ADD_RMS_NORM
from .fused import RMS_NORM, SWIGLU, triton_usable
from .linear_ce import linear_cross_entropy, linear_cross_entropy_ref
from .rope import ROPE_QK

LINEAR_CE = {
    "ref": linear_cross_entropy_ref,
    "torch": functools.partial(linear_cross_entropy, impl="torch"),
    "triton": functools.partial(linear_cross_entropy, impl="triton"),
}
IMPLS: dict[str, dict[str, Callable]] = {
    "rms_norm": RMS_NORM,
    "add_rms_norm": ADD_RMS_NORM,
    "swiglu": SWIGLU,
    "rope": ROPE_QK,
    "linear_ce": LINEAR_CE,
}


def candidates(op: str, device: torch.device | str) -> list[str]:
    """The implementations of `op` that can run on `device`, the reference first."""
    ok = triton_usable(device)[0]
    return [name for name in IMPLS[op] if name != "triton" or ok]


def _inputs(op: str, shape: tuple, dtype: torch.dtype, device) -> tuple[list, Callable]:
    """Random inputs of `op` at `shape` (the differentiable ones require grad) and a function
    that turns the implementation's output into one tensor to backpropagate."""
    gen = torch.Generator().manual_seed(0)

    def rnd(*s, grad=True):
        t = torch.randn(*s, generator=gen).to(device, dtype)
        return t.requires_grad_(grad)

    def total(out):
        return sum(o.float().sum() for o in out) if isinstance(out, tuple) else out.float().sum()

    if op == "rms_norm":
        return [rnd(*shape), rnd(shape[1])], total
    if op == "add_rms_norm":
        return [rnd(*shape), rnd(*shape), rnd(shape[1])], total
    if op == "swiglu":
        return [rnd(*shape), rnd(*shape)], total
    if op == "rope":
        b, s, h, kv, d = shape
        angles = torch.randn(s, d // 2, generator=gen).to(device)
        return [rnd(b, s, h, d), rnd(b, s, kv, d), angles.cos(), angles.sin()], total
    if op == "linear_ce":
        n, d, v = shape
        targets = torch.randint(0, v, (n,), generator=gen).to(device)
        weight = rnd(v, d)
        with torch.no_grad():
            weight.mul_(0.02)  # logits of order one, as a trained head's
        return [rnd(n, d), weight, targets], total
    raise ValueError(f"unknown kernel op {op!r}; one of {', '.join(IMPLS)}")


def measure(op: str, impl: str, shape: tuple, dtype: torch.dtype, device, repeats: int = 5) -> float:
    """Median seconds of one forward + backward of IMPLS[op][impl] at `shape` (after a warm-up)."""
    inputs, total = _inputs(op, shape, dtype, device)
    fn = IMPLS[op][impl]
    cuda = torch.device(device).type == "cuda"
    times = []
    for i in range(repeats + 1):
        for t in inputs:
            t.grad = None
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        total(fn(*inputs)).backward()
        if cuda:
            torch.cuda.synchronize(device)
        if i:  # the first call builds kernels and warms caches
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


class KernelChooser:
    """Per (op, shape, dtype) choice, made once and remembered (`table`, `times`).

    timer(op, impl, shape, dtype, device) -> seconds; agree(list of seconds) -> the list every
    rank decides from (None: this rank's own); say(line): where each decision is reported once.
    """

    def __init__(
        self,
        device: torch.device | str,
        *,
        timer: Callable[..., float] = measure,
        agree: Callable[[list[float]], list[float]] | None = None,
        margin: float = 0.05,
        say: Callable[[str], None] | None = None,
        allowed: Callable[[str, str], bool] | None = None,
    ):
        self.device, self.timer, self.agree = device, timer, agree
        self.margin, self.say, self.allowed = margin, say, allowed
        self.table: dict[tuple, str] = {}
        self.times: dict[tuple, dict[str, float]] = {}

    def pick(self, op: str, shape: tuple, dtype: torch.dtype) -> str:
        key = (op, tuple(shape), dtype)
        if key in self.table:
            return self.table[key]
        names = [n for n in candidates(op, self.device) if self.allowed is None or self.allowed(op, n)]
        if "ref" not in names:
            names.insert(0, "ref")
        if len(names) == 1:  # nothing to compare (CPU without Triton, say): no timing
            self.table[key], self.times[key] = "ref", {}
            return "ref"
        secs = [self.timer(op, name, tuple(shape), dtype, self.device) for name in names]
        if self.agree is not None:
            secs = list(self.agree(secs))
        times = dict(zip(names, secs))
        best = min(names, key=lambda n: (times[n], n != "ref"))
        choice = best if times[best] < times["ref"] * (1.0 - self.margin) else "ref"
        self.table[key], self.times[key] = choice, times
        if self.say is not None:
            self.say(self.describe(key))
        return choice

    def describe(self, key: tuple) -> str:
        op, shape, dtype = key
        times, choice = self.times[key], self.table[key]
        ref = times["ref"]
        rel = ", ".join(f"{n} {t * 1e3:.3g} ms ({ref / t:.2f}x)" for n, t in times.items() if t > 0)
        what = "x".join(map(str, shape))
        return f"kernel {op} [{what} {str(dtype).removeprefix('torch.')}]: {choice} ({rel})"
