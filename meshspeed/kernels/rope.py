"""Rotary embeddings applied to q and k at once: a reference, a complex-multiply torch path and
one Triton kernel per direction, all with the same signature.

    rope_qk_ref(q, k, cos, sin) / rope_qk_complex(...) / rope_qk_fused(...)  -> (q', k')

q [batch, seq, heads, head_dim], k [batch, seq, kv_heads, head_dim]; cos, sin [seq, head_dim/2]
or [batch, seq, head_dim/2] float32 (per-sample positions). Channel pairs (2i, 2i+1) rotate
(Meta's interleaved layout, models.layers.apply_rope). Every path computes in float32 and
rounds once to the input dtype, so results agree to float32 rounding (bf16: exactly, up to the
order of a multiply-add). The rotation is orthogonal: its backward is the rotation by -angle,
so nothing but the tables is saved.
"""

from __future__ import annotations

import functools

import torch

from .fused import check_inputs


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """models.layers.apply_rope: rotate adjacent channel pairs of x [b, s, h, d] in float32."""
    if cos.dim() == 2:
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    else:
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    x0, x1 = x.float().unflatten(-1, (-1, 2)).unbind(-1)  # each [batch, seq, heads, head_dim // 2]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


def rope_qk_ref(q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_ref(q, cos, sin), rope_ref(k, cos, sin)


def _complex_table(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    f = torch.complex(cos.float(), sin.float())  # [(batch,) seq, head_dim // 2]
    return f[None, :, None, :] if f.dim() == 2 else f[:, :, None, :]


def _rotate_complex(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(xc * f).flatten(-2).type_as(x)


def rope_qk_complex(q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    """One complex multiply per tensor (Meta's original formulation): fewer passes than the
    reference's four multiplies, a stack and a flatten."""
    f = _complex_table(cos, sin)
    return _rotate_complex(q, f), _rotate_complex(k, f)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rope(
        X, Y, COS, SIN, S, H, HALF, cos_batch_stride, sign, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr
    ):
        # One program per (batch, position): the tables' row is read once for all heads.
        row = tl.program_id(0)
        b, s = row // S, row % S
        i = tl.arange(0, BLOCK_D)
        h = tl.arange(0, BLOCK_H)
        tab = b * cos_batch_stride + s * HALF + i
        c = tl.load(COS + tab, mask=i < HALF, other=0.0)
        sn = tl.load(SIN + tab, mask=i < HALF, other=0.0) * sign
        mask = (h[:, None] < H) & (i[None, :] < HALF)
        offs = row * H * 2 * HALF + h[:, None] * 2 * HALF + 2 * i[None, :]  # [heads, pairs]
        x0 = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        x1 = tl.load(X + offs + 1, mask=mask, other=0.0).to(tl.float32)
        y0 = x0 * c[None, :] - x1 * sn[None, :]
        y1 = x0 * sn[None, :] + x1 * c[None, :]
        tl.store(Y + offs, y0.to(Y.dtype.element_ty), mask=mask)
        tl.store(Y + offs + 1, y1.to(Y.dtype.element_ty), mask=mask)

    return triton, rope


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    triton, kernel = _kernel()
    b, s, h, d = x.shape
    x = x.contiguous()
    y = torch.empty_like(x)
    stride = s * (d // 2) if cos.dim() == 3 else 0
    kernel[(b * s,)](
        x, y, cos, sin, s, h, d // 2, stride, sign,
        BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(d // 2),
    )  # fmt: skip
    return y


class _RopeQK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        ctx.save_for_backward(cos, sin)
        return _launch(q, cos, sin, 1.0), _launch(k, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, gq, gk):
        cos, sin = ctx.saved_tensors
        dq = None if gq is None else _launch(gq, cos, sin, -1.0)
        dk = None if gk is None else _launch(gk, cos, sin, -1.0)
        return dq, dk, None, None


def rope_qk_fused(q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    """rope_qk_ref in one Triton kernel per tensor and direction (one program per position)."""
    check_inputs(q)
    if q.shape[-1] % 2 or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"rope_qk_fused: head_dim {q.shape[-1]} / {k.shape[-1]} must be equal and even")
    return _RopeQK.apply(q, k, cos, sin)


ROPE_QK = {"ref": rope_qk_ref, "complex": rope_qk_complex, "triton": rope_qk_fused}
