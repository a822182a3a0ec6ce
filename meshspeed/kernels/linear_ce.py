"""Output projection + cross-entropy in row chunks, gradients computed in the forward pass
(Liger's fused linear cross-entropy): the [tokens, vocab] logits never exist and nothing is
recomputed.

    linear_cross_entropy_ref(hidden, weight, targets, ignore_index=-100)
    linear_cross_entropy(hidden, weight, targets, ignore_index=-100, *, chunk=0, group=None,
                         vocab_start=0, impl="torch")

hidden [..., dim], weight [vocab(/tp), dim], targets [...] (global ids); the mean over the
counted tokens, as kernels.loss.cross_entropy_loss(F.linear(hidden, weight), targets). Per
chunk of `chunk` rows: logits = h Wᵀ, the row loss and d loss/d logits = softmax − onehot
written over the logits (impl "torch": torch ops in float32; "triton": one kernel per chunk
reading the logits in their dtype and writing the gradient in place), then dh = g W and
dW += gᵀ h. The same three matmuls as the plain head, no [tokens, vocab] tensor kept: what waits
for backward is dh [tokens, dim] and dW [vocab, dim] (the gradient the weight receives anyway),
scaled there by the incoming gradient. With `group` the vocabulary is split over it
(Megatron's vocab-parallel cross-entropy, one all-reduce of the row maxima and one of the sums
per chunk); hidden and targets are then the same on every rank.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from meshspeed import comm

from .fused import check_inputs
from .loss import cross_entropy_loss


def linear_cross_entropy_ref(hidden, weight, targets, ignore_index: int = -100, **_unused) -> torch.Tensor:
    """The plain head: full logits, then kernels.loss.cross_entropy_loss."""
    return cross_entropy_loss(F.linear(hidden, weight), targets, ignore_index)


def default_chunk(rows: int, dim: int, vocab: int) -> int:
    """Liger's heuristic: chunks whose logits are about as large as the hidden states."""
    return max(1, min(rows, 2 ** math.ceil(math.log2(max(1, rows * dim // max(vocab, 1))))))


def _ce_torch(logits, targets, ignore_index, inv_n, group, vocab_start):
    """Row losses [c] (float32) and d loss / d logits [c, V] (float32, over a copy)."""
    x = logits.float()  # the chunk's own logits: worked on in place when already float32
    width = x.shape[1]
    m = x.amax(-1)
    if group is not None:
        comm.all_reduce(m, group, "max")
    x.sub_(m[:, None])
    local = targets - vocab_start
    in_range = (local >= 0) & (local < width)
    picked = x.gather(1, local.clamp(0, width - 1)[:, None]).squeeze(1) * in_range
    e = x.exp_()
    stats = torch.stack([e.sum(-1), picked])  # [2, c]: one all-reduce for both
    if group is not None:
        comm.all_reduce(stats, group)
    valid = targets != ignore_index
    rows = (stats[0].log() - stats[1]) * valid
    scale = valid * inv_n / stats[0]  # [c]
    g = e.mul_(scale[:, None])
    # the one-hot lives on the rank owning the target; a scatter, not a mask (no host sync)
    hit = (in_range & valid).to(g.dtype) * inv_n
    return rows, g.scatter_add_(1, local.clamp(0, width - 1)[:, None], -hit[:, None])


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def ce(L, T, LOSS, INV_N, V, ignore_index, BLOCK: tl.constexpr):
        # One program per row: an online max / sum over the vocabulary, then the gradient
        # (softmax - onehot) / n written over the logits.
        row = tl.program_id(0).to(tl.int64)
        base = L + row * V
        t = tl.load(T + row)
        m = tl.full((), float("-inf"), tl.float32)
        d = tl.full((), 0.0, tl.float32)
        for off in range(0, V, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m = m_new
        lse = m + tl.log(d)
        valid = t != ignore_index
        xt = tl.load(base + t, mask=valid, other=0.0).to(tl.float32)
        tl.store(LOSS + row, tl.where(valid, lse - xt, 0.0))
        scale = tl.where(valid, tl.load(INV_N), 0.0)
        for off in range(0, V, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < V, other=0.0).to(tl.float32)
            g = tl.exp(x - lse)
            g = tl.where(cols == t, g - 1.0, g) * scale
            tl.store(base + cols, g.to(L.dtype.element_ty), mask=cols < V)

    return triton, ce


def _ce_triton(logits, targets, ignore_index, inv_n):
    triton, kernel = _kernel()
    c, v = logits.shape
    rows = torch.empty(c, dtype=torch.float32, device=logits.device)
    inv = torch.as_tensor(inv_n, dtype=torch.float32, device=logits.device).reshape(1)
    kernel[(c,)](logits, targets, rows, inv, v, ignore_index, BLOCK=min(4096, triton.next_power_of_2(v)))
    return rows, logits


class _LinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, chunk, group, vocab_start, impl, want_grads):
        h = hidden.reshape(-1, hidden.shape[-1])  # [tokens, dim]
        t = targets.reshape(-1)
        rows, dim, vocab = h.shape[0], h.shape[1], weight.shape[0]
        chunk = chunk or default_chunk(rows, dim, vocab)
        valid = (t != ignore_index).sum()
        inv_n = 1.0 / valid.to(torch.float32)  # stays on the device: no host sync
        # needs_input_grad stays True under no_grad (validation): the caller's grad mode decides
        need_h, need_w = (want_grads and n for n in ctx.needs_input_grad[:2])
        grads = need_h or need_w
        dh = torch.empty_like(h) if need_h else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for a in range(0, rows, chunk):
            hc, tc = h[a : a + chunk], t[a : a + chunk]
            logits = hc @ weight.t()  # [chunk, vocab(/tp)]
            if impl == "triton" and group is None:
                loss_rows, g = _ce_triton(logits, tc, ignore_index, inv_n)
            else:
                loss_rows, g = _ce_torch(logits, tc, ignore_index, inv_n, group, vocab_start)
            total += loss_rows.sum()
            if grads:
                g = g.to(h.dtype)
                if dh is not None:
                    torch.matmul(g, weight, out=dh[a : a + chunk])
                if dw is not None and hc.dtype == dw.dtype:
                    dw.addmm_(g.t(), hc)
                elif dw is not None:  # a bf16 product per chunk, summed in float32
                    dw += g.t() @ hc
        loss = total * inv_n
        none = h.new_empty(0)
        ctx.save_for_backward(none if dh is None else dh, none if dw is None else dw.to(weight.dtype))
        ctx.shape = hidden.shape
        return loss

    @staticmethod
    def backward(ctx, g):
        dh, dw = ctx.saved_tensors
        gh = (dh * g.to(dh.dtype)).view(ctx.shape) if ctx.needs_input_grad[0] else None
        gw = dw * g.to(dw.dtype) if ctx.needs_input_grad[1] else None
        return gh, gw, None, None, None, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    *,
    chunk: int = 0,
    group: comm.Group | None = None,
    vocab_start: int = 0,
    impl: str = "torch",
) -> torch.Tensor:
    """Mean cross-entropy of hidden Wᵀ against targets, `chunk` rows at a time (0: Liger's
    size), its gradients formed in the forward pass. group/vocab_start: weight is this rank's
    slice of the vocabulary starting at id vocab_start. impl "triton": the Triton kernel for
    the softmax gradient (CUDA or TRITON_INTERPRET=1; without a group)."""
    if chunk < 0:
        raise ValueError(f"linear_cross_entropy chunk={chunk}; use a positive number of rows, or 0")
    if impl == "triton":
        check_inputs(hidden)
    elif impl != "torch":
        raise ValueError(f"linear_cross_entropy impl={impl!r}; use 'torch' or 'triton'")
    if group is not None and group.size == 1:
        group = None
    want = torch.is_grad_enabled()
    return _LinearCE.apply(hidden, weight, targets, ignore_index, chunk, group, vocab_start, impl, want)
