"""Fused RMSNorm and SwiGLU: a reference torch function and a Triton one with the same
signature, forward and backward.

    rms_norm_ref(x, weight, eps)   / rms_norm_fused(x, weight, eps)    x [..., dim], weight [dim]
    swiglu_ref(gate, up)           / swiglu_fused(gate, up)            silu(gate) * up, same shapes

The Triton kernels run on CUDA, or anywhere under Triton's interpreter (TRITON_INTERPRET=1, how
CI checks them on CPU). They are built on first use, not at import: the interpreter switch is
read when a kernel is decorated, and tests set it after meshspeed is imported. Arithmetic is
float32 inside the kernels whatever the input dtype; the result is cast back once (the
reference casts the normalised value before the weight multiply, so bf16 results differ by
about one bf16 rounding, 2^-8 relative).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """models.layers.RMSNorm's arithmetic: normalised in float32, weight applied in x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.type_as(x) * weight


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


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
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def rms_fwd(X, W, Y, RSTD, D, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        x = tl.load(X + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        tl.store(RSTD + row, rstd)
        tl.store(Y + row * D + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def rms_bwd(X, W, G, RSTD, DX, DWP, D, BLOCK: tl.constexpr):
        # dx = rstd · (w·g − x̂ · mean(w·g·x̂)); the per-row dw partials g·x̂ are summed outside.
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        x = tl.load(X + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        xhat = x * rstd
        wg = w * g
        c = tl.sum(wg * xhat, axis=0) / D
        tl.store(DX + row * D + cols, (rstd * (wg - xhat * c)).to(DX.dtype.element_ty), mask=mask)
        tl.store(DWP + row * D + cols, g * xhat, mask=mask)

    @triton.jit
    def swiglu_fwd(A, B, Y, N, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
        s = 1.0 / (1.0 + tl.exp(-a))
        tl.store(Y + offs, (a * s * b).to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def swiglu_bwd(A, B, G, DA, DB, N, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
        s = 1.0 / (1.0 + tl.exp(-a))
        tl.store(DA + offs, (g * b * s * (1.0 + a * (1.0 - s))).to(DA.dtype.element_ty), mask=mask)
        tl.store(DB + offs, (g * a * s).to(DB.dtype.element_ty), mask=mask)

    return triton, rms_fwd, rms_bwd, swiglu_fwd, swiglu_bwd


def check_inputs(*ts: torch.Tensor) -> None:
    ok, why = triton_usable(ts[0].device)
    if not ok:
        raise RuntimeError(
            f"fused kernels unavailable on {ts[0].device}: {why}; use train.fused_kernels=false"
        )


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        triton, fwd, _, _, _ = _kernels()
        shape, d = x.shape, x.shape[-1]
        x2 = x.reshape(-1, d).contiguous()  # [rows, dim]
        y = torch.empty_like(x2, dtype=torch.promote_types(x.dtype, weight.dtype))
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(d)
        fwd[(x2.shape[0],)](x2, weight.contiguous(), y, rstd, d, eps, BLOCK=block)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape, ctx.block = shape, block
        return y.view(shape)

    @staticmethod
    def backward(ctx, g):
        _, _, bwd, _, _ = _kernels()
        x2, weight, rstd = ctx.saved_tensors
        g2 = g.reshape(x2.shape).contiguous()
        dx = torch.empty_like(x2)
        dw_part = torch.empty(x2.shape, dtype=torch.float32, device=x2.device)  # [rows, dim]
        bwd[(x2.shape[0],)](x2, weight.contiguous(), g2, rstd, dx, dw_part, x2.shape[1], BLOCK=ctx.block)
        return dx.view(ctx.shape), dw_part.sum(0).to(weight.dtype), None


class _SwiGLU(torch.autograd.Function):
    BLOCK = 1024

    @staticmethod
    def forward(ctx, gate, up):
        triton, _, _, fwd, _ = _kernels()
        a, b = gate.contiguous(), up.contiguous()
        y = torch.empty_like(a)
        n = a.numel()
        fwd[(triton.cdiv(n, _SwiGLU.BLOCK),)](a, b, y, n, BLOCK=_SwiGLU.BLOCK)
        ctx.save_for_backward(a, b)
        return y

    @staticmethod
    def backward(ctx, g):
        triton, _, _, _, bwd = _kernels()
        a, b = ctx.saved_tensors
        da, db = torch.empty_like(a), torch.empty_like(b)
        n = a.numel()
        bwd[(triton.cdiv(n, _SwiGLU.BLOCK),)](a, b, g.contiguous(), da, db, n, BLOCK=_SwiGLU.BLOCK)
        return da, db


def rms_norm_fused(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """rms_norm_ref in one Triton kernel per direction (one program per row)."""
    check_inputs(x)
    return _RMSNorm.apply(x, weight, eps)


def swiglu_fused(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """swiglu_ref in one Triton kernel per direction."""
    check_inputs(gate)
    if gate.shape != up.shape:
        raise ValueError(f"swiglu_fused: gate {list(gate.shape)} and up {list(up.shape)} must match")
    return _SwiGLU.apply(gate, up)


# Implementations by name, for kernels.choose: "ref" is the reference, the others its equals.
RMS_NORM = {"ref": rms_norm_ref, "triton": rms_norm_fused}
SWIGLU = {"ref": swiglu_ref, "triton": swiglu_fused}
