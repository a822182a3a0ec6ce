"""Ring attention's arithmetic (split out of context.py, which plans the blocks and holds the
cores): one block — a query chunk against a key/value chunk, forward and backward — the
online-softmax merge of blocks, and the ring loops that pass key/value blocks (and, backward,
their gradients) around the ring while each rank computes its blocks.

A block's mask is None (fully visible), CAUSAL (query and key chunk hold the same positions) or
a boolean mask (packed documents). The first two run the fused flash kernel on the CPU; every
other case — and every device but the CPU — runs the explicit-mask path (`fused` says which).
"""

from __future__ import annotations

import math

import torch

from meshspeed.comm.group import Group

from .context_comm import RingStats, RingStep

CAUSAL = "causal"  # a block mask: query and key chunk hold the same positions (lower triangle)
FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def fused(q, mask) -> bool:
    """CPU blocks with no mask or the plain causal one go through torch's flash kernel, which
    also returns the log-sum-exp; document masks (rows may be fully masked) take the explicit path."""
    return q.device.type == "cpu" and (mask is None or mask is CAUSAL)


def heads(q, k):
    """[b, g, r, s, hd] / [b, g, sk, hd] -> [b, g·r, s, hd] each (kv heads expanded for the kernel)."""
    b, g, r, s, d = q.shape
    return q.reshape(b, g * r, s, d), k[:, :, None].expand(b, g, r, *k.shape[2:]).reshape(b, g * r, -1, d)


def causal_mask(mask, q, k):
    if mask is CAUSAL:
        return torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    return mask


def block_fwd(q, k, v, scale, mask):
    """Attention of q [b, g, r, sq, hd] over k/v [b, g, sk, hd] (r query heads per kv head), float32.
    Returns the normalised output and its log-sum-exp; a fully masked row gives 0 and -inf, never NaN."""
    if fused(q, mask):
        qh, kh = heads(q, k)
        out, lse = FLASH(qh, kh, heads(q, v)[1], 0.0, mask is CAUSAL, scale=scale)
        return out.view(q.shape), lse.view(q.shape[:-1])
    mask = causal_mask(mask, q, k)
    s = torch.einsum("bgrqd,bgkd->bgrqk", q, k) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True)
    out = torch.einsum("bgrqk,bgkd->bgrqd", p, v) / denom.clamp_min(torch.finfo(p.dtype).tiny)
    return out, (m + denom.log()).squeeze(-1)


def block_bwd(q, k, v, do, out, delta, lse, scale, mask):
    """Gradients of one block given the final (merged) lse and delta = rowsum(dO·O) (the fused
    kernel takes the merged output instead and forms delta itself)."""
    if fused(q, mask):
        b, g, r, sq, d = q.shape
        qh, kh = heads(q, k)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do.reshape(b, g * r, sq, d),
            qh,
            kh,
            heads(q, v)[1],
            out.reshape(b, g * r, sq, d),
            lse.reshape(b, g * r, sq),
            0.0,
            mask is CAUSAL,
            scale=scale,
        )
        return dq.reshape(q.shape), dk.reshape(b, g, r, -1, d).sum(2), dv.reshape(b, g, r, -1, d).sum(2)
    mask = causal_mask(mask, q, k)
    s = torch.einsum("bgrqd,bgkd->bgrqk", q, k) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe[..., None])  # the block's share of the full softmax
    dv = torch.einsum("bgrqk,bgrqd->bgkd", p, do)
    ds = p * (torch.einsum("bgrqd,bgkd->bgrqk", do, v) - delta[..., None])
    dq = torch.einsum("bgrqk,bgkd->bgrqd", ds, k) * scale
    dk = torch.einsum("bgrqk,bgrqd->bgkd", ds, q) * scale
    return dq, dk, dv


def merge(out, lse, a, b, o_blk, lse_blk) -> None:
    old = lse[..., a:b]
    new = torch.logaddexp(old, lse_blk)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    out[..., a:b, :] = (
        out[..., a:b, :] * (old - safe).exp()[..., None] + o_blk * (lse_blk - safe).exp()[..., None]
    )
    lse[..., a:b] = new


def ring_forward(q, k, v, group: Group, works: list, stats: RingStats | None):
    """Ring attention of q [b, g, r, sq, hd] over k/v [b, g, sk, hd] float32 (works[j]: blocks
    against ring member j). Returns the output and its log-sum-exp [b, g, r, sq]."""
    p, me = group.size, group.rank
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    kv = torch.stack([k, v])  # [2, b, g, sk, hd]: one message per step
    for t in range(p):
        step = RingStep(kv, group, 1, stats) if t < p - 1 else None  # in flight during compute
        for a, b, kidx, mask in works[(me - t) % p]:
            o_blk, lse_blk = block_fwd(q[..., a:b, :], kv[0][:, :, kidx], kv[1][:, :, kidx], scale, mask)
            merge(out, lse, a, b, o_blk, lse_blk)
        if step is not None:
            kv = step.wait()
    return out, lse


def ring_backward(dout, q, k, v, out, lse, group: Group, works: list, stats: RingStats | None):
    """dq, dk, dv of ring_forward: dK/dV travel the ring with their block."""
    p, me = group.size, group.rank
    scale = 1.0 / math.sqrt(q.shape[-1])
    dout = dout.contiguous()
    delta = (dout * out).sum(-1)
    dq = torch.zeros_like(q)
    kv = torch.stack([k, v])
    incoming = None  # the dK/dV accumulated so far for the block we hold, from the previous rank
    for t in range(p):
        step = RingStep(kv, group, 1, stats) if t < p - 1 else None
        dkv = torch.zeros_like(kv)
        for a, b, kidx, mask in works[(me - t) % p]:
            dq_b, dk_b, dv_b = block_bwd(
                q[..., a:b, :],
                kv[0][:, :, kidx],
                kv[1][:, :, kidx],
                dout[..., a:b, :],
                out[..., a:b, :],
                delta[..., a:b],
                lse[..., a:b],
                scale,
                mask,
            )
            dq[..., a:b, :] += dq_b
            dkv[0][:, :, kidx] += dk_b
            dkv[1][:, :, kidx] += dv_b
        if incoming is not None:
            dkv += incoming.wait()
        # The block moves on to the next rank, and after p shifts its gradient is home.
        incoming = RingStep(dkv, group, 2, stats) if p > 1 else None
        if step is not None:
            kv = step.wait()
    dkv = incoming.wait() if incoming is not None else dkv
    return dq, dkv[0], dkv[1]
