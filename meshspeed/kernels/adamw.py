"""AdamW over one flat fp32 shard in one pass: the optimizer kernel of meshspeed.parallel.optim.

    adamw_(master, grad, exp_avg, exp_avg_sq, hp, layout, clip_coef=None, found_inf=None, out=None)

reads the gradient, the fp32 master and both moments once, and writes the master, the moments
and (`out`, bf16 parameters say) the published parameter in the same pass. Weight decay comes
from the shard's `DecayLayout` (which elements are decayed), not from a pass per parameter;
`clip_coef` (a 0-d tensor: global-norm clipping's factor) scales the gradient inside the pass,
and the buckets keep the scaled gradient, as clip_grad_norm_ would leave them; `found_inf` (a
0-d tensor, nonzero: skip) turns every write off, so a step can be issued before the norm is
read back.

Three implementations with one signature:

- `adamw_reference`: ZeroAdamW's original arithmetic (torch.optim.AdamW's single-tensor op
  order: decay, lerp, mul + addcmul, sqrt / bias correction + eps, addcdiv), one pass per term:
  the oracle the others are tested against.
- `adamw_triton` (CUDA, or CPU under TRITON_INTERPRET=1): that arithmetic in one kernel, each
  step rounded as the reference rounds it (fused multiply-adds where ATen's lerp uses them,
  IEEE square root and division), so float32 results equal the reference bit for bit.
- `adamw_torch` (CPU and any device torch's fused AdamW supports): torch._fused_adamw_ over the
  decayed and the undecayed elements (two calls at most; clipping as its grad_scale, which
  divides by 1 / coef), then the publish copy. This is torch.optim.AdamW(fused=True)'s
  arithmetic, and its rounding differs from the single-tensor one's: against the reference the
  values drift apart by a few ulps (of the update term) per step, the difference between
  torch's own fused and single-tensor AdamW. `impl="reference"` keeps the old bits.

`adamw_` picks Triton on CUDA and torch's fused kernel elsewhere (impl="auto"); both are
measured against the per-term passes in benchmarks/trainer_overhead.py.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

GROUP = 16  # elements per decay-mask entry: bucket slots start 16-aligned (buckets.ALIGN)
IMPLS = ("auto", "triton", "torch", "reference")


@dataclass(frozen=True)
class AdamWHyper:
    """One step's scalars, computed as torch.optim.AdamW (single-tensor) computes them."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int

    @property
    def decay_factor(self) -> float:
        return 1 - self.lr * self.weight_decay

    @property
    def step_size(self) -> float:
        return self.lr / (1 - self.beta1**self.step)

    @property
    def bias_correction2_sqrt(self) -> float:
        return (1 - self.beta2**self.step) ** 0.5


class DecayLayout:
    """Which elements of a flat shard of `numel` get weight decay: `ranges`, [a, e) pairs
    (buckets.segments). Kept as the ranges (the reference), the views of each range (torch's
    fused kernel takes lists), and a byte per 16-element group (the Triton kernel: slots start
    16-aligned, so a group is never split between a decayed and an undecayed parameter)."""

    def __init__(self, numel: int, ranges: list[tuple[int, int]]):
        self.numel, self.ranges = numel, [(a, e) for a, e in ranges if e > a]
        rest, at = [], 0
        for a, e in self.ranges:
            if a > at:
                rest.append((at, a))
            at = e
        if at < numel:
            rest.append((at, numel))
        self.rest = rest
        self._mask: dict[torch.device, torch.Tensor] = {}

    @property
    def all_decayed(self) -> bool:
        return not self.rest

    @property
    def none_decayed(self) -> bool:
        return not self.ranges

    def mask(self, device: torch.device) -> torch.Tensor:
        """uint8 [ceil(numel / 16)]: 1 where the group is decayed."""
        m = self._mask.get(device)
        if m is None:
            m = torch.zeros(-(-self.numel // GROUP), dtype=torch.uint8)
            for a, e in self.ranges:
                m[a // GROUP : -(-e // GROUP)] = 1
            self._mask[device] = m = m.to(device)
        return m

    def split(self, t: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(views of the decayed ranges, views of the rest) of the flat `t`."""
        return [t[a:e] for a, e in self.ranges], [t[a:e] for a, e in self.rest]


# ---------------------------------------------------------------------------- reference
@torch.no_grad()
def adamw_reference(master, grad, exp_avg, exp_avg_sq, hp: AdamWHyper, layout: DecayLayout, *,
                    clip_coef=None, found_inf=None, out=None, ieee_sqrt: bool = False) -> None:  # fmt: skip
    """ieee_sqrt: a correctly rounded square root (CUDA's and Triton's sqrt_rn are; torch's
    vectorised CPU one is not always): how tests check the kernel's every other rounding."""
    if found_inf is not None and bool(found_inf):
        return
    if clip_coef is not None:
        grad.mul_(clip_coef.to(grad.device))
    g = grad if grad.dtype == torch.float32 else grad.float()
    if hp.weight_decay:
        for a, e in layout.ranges:
            master[a:e].mul_(hp.decay_factor)
    exp_avg.lerp_(g, 1 - hp.beta1)
    exp_avg_sq.mul_(hp.beta2).addcmul_(g, g, value=1 - hp.beta2)
    root = exp_avg_sq.double().sqrt().float() if ieee_sqrt else exp_avg_sq.sqrt()
    denom = (root / hp.bias_correction2_sqrt).add_(hp.eps)
    master.addcdiv_(exp_avg, denom, value=-hp.step_size)
    if out is not None:
        out.copy_(master)


# ------------------------------------------------------------------ torch's fused kernel
class ViewCache:
    """Views of the decayed / undecayed ranges, rebuilt only when a buffer moves (offloaded and
    shared masters are new tensors each step): slicing is an operator call of its own."""

    def __init__(self):
        self._key, self._views = None, None

    def get(self, layout: DecayLayout, tensors: tuple[torch.Tensor, ...]):
        key = tuple((t.data_ptr(), t.numel()) for t in tensors) + (id(layout),)
        if key != self._key:
            self._key, self._views = key, [layout.split(t) for t in tensors]
        return self._views


@torch.no_grad()
def adamw_torch(master, grad, exp_avg, exp_avg_sq, hp: AdamWHyper, layout: DecayLayout, *,
                clip_coef=None, found_inf=None, out=None, step_t=None, cache=None,
                grad_scale=None) -> None:  # fmt: skip
    """step_t: a float32 0-d tensor holding hp.step on master's device (set once per step by
    the caller, else made here); cache: a ViewCache kept per shard by the caller; grad_scale:
    1 / clip_coef, made once per step by the caller (else here)."""
    if found_inf is not None and bool(found_inf):
        return
    g = grad
    if clip_coef is not None and grad.dtype != master.dtype:  # the bucket keeps the product
        grad.mul_(clip_coef if clip_coef.device == grad.device else clip_coef.to(grad.device))
        clip_coef = None
    if grad.dtype != master.dtype:
        g = grad.to(master.dtype)
    if step_t is None:
        step_t = torch.tensor(float(hp.step), device=master.device)
    # clipping inside the kernel: torch's grad_scale divides (by 1 / coef, within a rounding of
    # the product) and writes the scaled gradient back into the bucket, as clipping leaves it
    scale = None
    if clip_coef is not None:
        scale = grad_scale if grad_scale is not None else clip_coef.to(master.device).reciprocal()
    kw = dict(lr=hp.lr, beta1=hp.beta1, beta2=hp.beta2, eps=hp.eps, amsgrad=False, maximize=False,
              grad_scale=scale)  # fmt: skip
    if not hp.weight_decay or layout.all_decayed or layout.none_decayed:
        wd = hp.weight_decay if layout.all_decayed else 0.0
        torch._fused_adamw_([master], [g], [exp_avg], [exp_avg_sq], [], [step_t], weight_decay=wd, **kw)
    else:
        (pd, pr), (gd, gr), (md, mr), (vd, vr) = (cache or ViewCache()).get(
            layout, (master, g, exp_avg, exp_avg_sq)
        )
        torch._fused_adamw_(pd, gd, md, vd, [], [step_t] * len(pd), weight_decay=hp.weight_decay, **kw)
        torch._fused_adamw_(pr, gr, mr, vr, [], [step_t] * len(pr), weight_decay=0.0, **kw)
    if out is not None:
        out.copy_(master)


# ------------------------------------------------------------------------------- Triton
def triton_usable(device: torch.device | str) -> tuple[bool, str]:
    """(usable, why not): Triton installed, and a CUDA tensor or the interpreter."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False, "triton is not installed (pip install triton)"
    if torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return True, ""
    return False, "Triton kernels run on CUDA, or on CPU under TRITON_INTERPRET=1"


@functools.cache
def _kernel():
    # built on first use, not at import: the interpreter switch is read at decoration time
    import triton
    import triton.language as tl

    @triton.jit
    def adamw_kernel(P, G, M, V, OUT, DECAY, COEF, SKIP, n, decay_factor, w1, beta2, c2, bc2, eps,
                     neg_step, LERP_SMALL: tl.constexpr, CUDA_ORDER: tl.constexpr, HAS_OUT: tl.constexpr,
                     HAS_DECAY: tl.constexpr, HAS_COEF: tl.constexpr, HAS_SKIP: tl.constexpr,
                     BLOCK: tl.constexpr):  # fmt: skip
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        if HAS_SKIP:  # a non-finite step writes nothing at all
            n = tl.where(tl.load(SKIP) == 0, n, 0)
        live = offs < n
        p = tl.load(P + offs, mask=live, other=0.0)
        g = tl.load(G + offs, mask=live, other=0.0)
        if HAS_COEF:  # clipping: the product clip_grad_norm_'s mul_ makes, kept in the bucket
            coef = tl.load(COEF)
            if CUDA_ORDER and G.dtype.element_ty != tl.float32:
                # ATen on CUDA casts the 0-d float32 factor (a CUDA tensor, not a CPU scalar) to
                # the gradient's dtype before the product; the CPU takes a 0-d CPU tensor as a
                # scalar at full precision. An H200 run found the difference (many ulps of the
                # master with bf16 gradients, clipped); compiled, the cast rounds to nearest even.
                coef = coef.to(G.dtype.element_ty).to(tl.float32)
            g = g.to(tl.float32) * coef
            if G.dtype.element_ty == tl.bfloat16:  # rounded as torch rounds (see the publish)
                bits = g.to(tl.uint32, bitcast=True)
                bits = tl.where(g != g, 0x7FC0, (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)
                g = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
                tl.store(G + offs, g, mask=live)
                g = g.to(tl.float32)
            else:
                tl.store(G + offs, g.to(G.dtype.element_ty), mask=live)
        g = g.to(tl.float32)
        if HAS_DECAY:
            d = tl.load(DECAY + offs // 16, mask=live, other=0)
            p = tl.where(d != 0, p * decay_factor, p)
        m = tl.load(M + offs, mask=live, other=0.0)
        v = tl.load(V + offs, mask=live, other=0.0)
        # exp_avg.lerp_(g, w1): ATen's lerp is one fused multiply-add from the nearer end
        if LERP_SMALL:
            m = tl.fma(g - m, w1, m)
        else:
            m = tl.fma(g - m, w1 - 1.0, g)
        # exp_avg_sq.mul_(beta2).addcmul_(g, g, value=c2), then denom = sqrt / bc2 + eps and
        # master.addcdiv_(m, denom, value=neg_step), rounded where ATen rounds them: on the CPU
        # (vectorised, compiler-fused) (c2·g)·g + v·b2 in one fma, a true division by bc2 and
        # (neg_step·m) / denom added; on CUDA (DeviceAddCmulCdiv.cuh) fma(c2, g·g, v·b2), a
        # multiply by the scalar divisor's reciprocal (bc2 is passed as 1/bc2) and
        # fma(neg_step, m / denom, p)
        if CUDA_ORDER:
            v = tl.fma(g * g, c2, v * beta2)
            denom = tl.sqrt_rn(v) * bc2 + eps
            p = tl.fma(tl.div_rn(m, denom), neg_step, p)
        else:
            v = tl.fma(c2 * g, g, v * beta2)
            denom = tl.div_rn(tl.sqrt_rn(v), bc2) + eps
            p = p + tl.div_rn(neg_step * m, denom)
        tl.store(P + offs, p, mask=live)
        tl.store(M + offs, m, mask=live)
        tl.store(V + offs, v, mask=live)
        if HAS_OUT:
            if OUT.dtype.element_ty == tl.bfloat16:
                # round to nearest even by hand, as torch's copy_ does (the interpreter's own
                # cast truncates); NaN stays a quiet NaN
                bits = p.to(tl.uint32, bitcast=True)
                bits = tl.where(p != p, 0x7FC0, (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)
                tl.store(OUT + offs, bits.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=live)
            else:
                tl.store(OUT + offs, p.to(OUT.dtype.element_ty), mask=live)

    return adamw_kernel


@torch.no_grad()
def adamw_triton(master, grad, exp_avg, exp_avg_sq, hp: AdamWHyper, layout: DecayLayout, *,
                 clip_coef=None, found_inf=None, out=None, block: int = 2048) -> None:  # fmt: skip
    n = master.numel()
    if not n:
        return
    for t in (grad, exp_avg, exp_avg_sq) + ((out,) if out is not None else ()):
        if not t.is_contiguous() or t.numel() != n:
            raise ValueError(f"adamw_triton: every buffer must be contiguous with {n} elements")
    decay = hp.weight_decay and not layout.none_decayed
    w1 = 1 - hp.beta1
    cuda = master.device.type == "cuda"
    # CUDA divides by a host scalar as a product with its float32 reciprocal
    bc2 = hp.bias_correction2_sqrt
    if cuda:
        bc2 = float(torch.tensor(1.0) / torch.tensor(bc2))
    dummy = master  # pointers of disabled features are never read
    # Compiled, the kernel must not fuse a multiply into a neighbouring add on its own (the decay
    # product into the update's add, say): products round where the reference's do, and its
    # fused multiply-adds are written out. The interpreter rounds every operation anyway.
    _kernel()[(triton_grid(n, block),)](
        master, grad, exp_avg, exp_avg_sq,
        out if out is not None else dummy,
        layout.mask(master.device) if decay else dummy,
        clip_coef.to(device=master.device, dtype=torch.float32) if clip_coef is not None else dummy,
        found_inf.to(device=master.device, dtype=torch.float32) if found_inf is not None else dummy,
        n, hp.decay_factor, w1, hp.beta2, 1 - hp.beta2, bc2, hp.eps, -hp.step_size,
        LERP_SMALL=abs(w1) < 0.5, CUDA_ORDER=cuda, HAS_OUT=out is not None, HAS_DECAY=bool(decay),
        HAS_COEF=clip_coef is not None, HAS_SKIP=found_inf is not None, BLOCK=block,
        **({} if os.environ.get("TRITON_INTERPRET") == "1" else {"enable_fp_fusion": False}),
    )  # fmt: skip


def triton_grid(n: int, block: int) -> int:
    return -(-n // block)


# ------------------------------------------------------------------------------ dispatch
def resolve_impl(impl: str, device: torch.device) -> str:
    """'auto' -> 'triton' on CUDA (when Triton is installed), else 'torch'."""
    if impl not in IMPLS:
        raise ValueError(f"adamw impl={impl!r}; valid: {', '.join(IMPLS)}")
    if impl == "auto":
        return "triton" if device.type == "cuda" and triton_usable(device)[0] else "torch"
    if impl == "triton":
        ok, why = triton_usable(device)
        if not ok:
            raise ValueError(f"adamw impl='triton' on {device}: {why}")
    return impl


def adamw_(master, grad, exp_avg, exp_avg_sq, hp: AdamWHyper, layout: DecayLayout, *,
           impl: str = "auto", clip_coef=None, found_inf=None, out=None, step_t=None, cache=None,
           grad_scale=None) -> None:  # fmt: skip
    """One AdamW step over a flat fp32 shard (see the module docstring)."""
    impl = resolve_impl(impl, master.device)
    kw = dict(clip_coef=clip_coef, found_inf=found_inf, out=out)
    if impl == "triton":
        adamw_triton(master, grad, exp_avg, exp_avg_sq, hp, layout, **kw)
    elif impl == "torch":
        adamw_torch(master, grad, exp_avg, exp_avg_sq, hp, layout, step_t=step_t, cache=cache,
                    grad_scale=grad_scale, **kw)  # fmt: skip
    else:
        adamw_reference(master, grad, exp_avg, exp_avg_sq, hp, layout, **kw)
