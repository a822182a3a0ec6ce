"""The residual add and the RMSNorm that follows it, in one pass over the row.

    add_rms_norm_ref(x, residual, weight, eps) / add_rms_norm_fused(...)  -> (h, y)

h = x + residual (the new residual stream, in x's dtype), y = RMSNorm(h) * weight (kernels.fused
rms_norm_ref's arithmetic on the rounded h). The reference reads x and residual, writes h, reads h
again, writes y; the kernel reads x and residual once and writes h and y. Backward: the
gradient reaching h is its own plus the norm's, and x and residual both get it (one tensor,
returned twice). Tolerances as kernels.fused: the kernel rounds y once, the reference twice.
"""

from __future__ import annotations

import functools

import torch

from .fused import check_inputs, rms_norm_ref


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5
) -> tuple[torch.Tensor, torch.Tensor]:
    h = x + residual
    return h, rms_norm_ref(h, weight, eps)


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def fwd(X, R, W, H, Y, RSTD, D, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        x = tl.load(X + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(R + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        h = (x + r).to(H.dtype.element_ty)  # the stream keeps its dtype; the norm sees it rounded
        tl.store(H + row * D + cols, h, mask=mask)
        hf = h.to(tl.float32)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / D + eps)
        tl.store(RSTD + row, rstd)
        tl.store(Y + row * D + cols, (hf * rstd * w).to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def bwd(H, W, GY, GH, RSTD, DX, DWP, D, BLOCK: tl.constexpr):
        # dh = gh + rstd · (w·gy − ĥ · mean(w·gy·ĥ)); per-row dw partials gy·ĥ summed outside
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < D
        h = tl.load(H + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        gy = tl.load(GY + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        gh = tl.load(GH + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        hhat = h * rstd
        wg = w * gy
        c = tl.sum(wg * hhat, axis=0) / D
        dh = gh + rstd * (wg - hhat * c)
        tl.store(DX + row * D + cols, dh.to(DX.dtype.element_ty), mask=mask)
        tl.store(DWP + row * D + cols, gy * hhat, mask=mask)

    return triton, fwd, bwd


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        triton, fwd, _ = _kernels()
        shape, d = x.shape, x.shape[-1]
        x2 = x.reshape(-1, d).contiguous()  # [rows, dim]
        r2 = residual.reshape(-1, d).contiguous()
        h = torch.empty_like(x2, dtype=torch.promote_types(x.dtype, residual.dtype))
        y = torch.empty_like(h, dtype=torch.promote_types(h.dtype, weight.dtype))
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(d)
        fwd[(x2.shape[0],)](x2, r2, weight.contiguous(), h, y, rstd, d, eps, BLOCK=block)
        ctx.save_for_backward(h, weight, rstd)
        ctx.shape, ctx.block, ctx.dtypes = shape, block, (x.dtype, residual.dtype)
        return h.view(shape), y.view(shape)

    @staticmethod
    def backward(ctx, gh, gy):
        _, _, bwd = _kernels()
        h, weight, rstd = ctx.saved_tensors
        gy = torch.zeros_like(h) if gy is None else gy.reshape(h.shape).contiguous()
        gh = torch.zeros_like(h) if gh is None else gh.reshape(h.shape).contiguous()
        dx = torch.empty_like(h)
        dw_part = torch.empty(h.shape, dtype=torch.float32, device=h.device)  # [rows, dim]
        bwd[(h.shape[0],)](h, weight.contiguous(), gy, gh, rstd, dx, dw_part, h.shape[1], BLOCK=ctx.block)
        dx = dx.view(ctx.shape)
        return dx.to(ctx.dtypes[0]), dx.to(ctx.dtypes[1]), dw_part.sum(0).to(weight.dtype), None


def add_rms_norm_fused(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5
) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm_ref in one Triton kernel per direction (one program per row)."""
    check_inputs(x)
    if x.shape != residual.shape:
        raise ValueError(f"add_rms_norm: x {list(x.shape)} and residual {list(residual.shape)} must match")
    return _AddRMSNorm.apply(x, residual, weight, eps)


ADD_RMS_NORM = {"ref": add_rms_norm_ref, "triton": add_rms_norm_fused}
