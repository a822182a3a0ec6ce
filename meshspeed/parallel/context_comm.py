"""Communication of context parallelism: the Ulysses head/sequence all-to-all and the ring's
key/value passing. Every byte goes through meshspeed.comm (tracing, timeouts, algorithm choice).

Timing of the ring's waits is kept in `RingStats` so the benchmark can tell how much of the
transfer time compute hid.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from meshspeed import comm
from meshspeed.comm.group import Group


def seq_to_heads(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[batch, seq/P, heads, hd] -> [batch, seq, heads/P, hd]; the sequence comes back in member
    order (member j's rows at j*seq/P). Differentiable: the backward is heads_to_seq."""
    p = group.size
    if p == 1:
        return x
    b, s, h, d = x.shape
    # [P (head chunk: goes to member j), batch, seq/P, heads/P, hd]
    send = x.reshape(b, s, p, h // p, d).permute(2, 0, 1, 3, 4).contiguous()
    got = comm.all_to_all_ad(send, group)  # [P (source member), batch, seq/P, heads/P, hd]
    return got.permute(1, 0, 2, 3, 4).reshape(b, p * s, h // p, d)


def heads_to_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[batch, seq, heads/P, hd] -> [batch, seq/P, heads, hd], the inverse of seq_to_heads."""
    p = group.size
    if p == 1:
        return x
    b, s, h, d = x.shape
    send = x.reshape(b, p, s // p, h, d).transpose(0, 1).contiguous()  # [P (seq chunk), b, s/P, h/P, hd]
    got = comm.all_to_all_ad(send, group)  # [P (head chunk from member j), b, s/P, h/P, hd]
    return got.permute(1, 2, 0, 3, 4).reshape(b, s // p, p * h, d)


def gather_ints(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[batch, n] (document ids, no gradient) -> [P, batch, n]: every member's tensor."""
    if group.size == 1:
        return x[None]
    return comm.all_gather(x.contiguous()[None], group, dim=0)


class _GatherTokens(torch.autograd.Function):
    """[B, n, ...] -> [B, P·n, ...], member order. Every member then computes the same loss on
    the whole output and the gradient reduction averages over the cp ranks (dp_cp, as for every
    family), so the backward keeps this member's rows times P: the average of the members'
    partial gradients is then the whole one (train/objectives' _CpSum does the same for sums)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.all_gather(x.contiguous(), group, 1)

    @staticmethod
    def backward(ctx, g):
        p, n = ctx.group.size, g.shape[1] // ctx.group.size
        return g.narrow(1, ctx.group.rank * n, n) * p, None


def gather_tokens(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Every member's tokens [B, n, ...] -> [B, P·n, ...] (see _GatherTokens for the gradient)."""
    return x if group.size == 1 else _GatherTokens.apply(x, group)


@dataclass
class RingStats:
    """Seconds blocked on ring transfers (forward + backward), how many shifts, bytes sent."""

    wait_s: float = 0.0
    transfers: int = 0
    bytes: int = 0


class RingStep:
    """One asynchronous shift around the ring: send `tensor` to the next member, receive the
    previous member's into a new buffer. `wait()` returns the received tensor."""

    def __init__(self, tensor: torch.Tensor, group: Group, tag: int, stats: RingStats | None):
        p, r = group.size, group.rank
        self.buf = torch.empty_like(tensor)
        self.stats = stats
        self.handle = comm.batch(
            [
                comm.P2P("send", tensor.contiguous(), (r + 1) % p, tag),
                comm.P2P("recv", self.buf, (r - 1) % p, tag),
            ],
            group,
        )
        if stats is not None:
            stats.transfers += 1
            stats.bytes += tensor.numel() * tensor.element_size()

    def wait(self) -> torch.Tensor:
        t0 = time.perf_counter()
        self.handle.wait()
        if self.stats is not None:
            self.stats.wait_s += time.perf_counter() - t0
        return self.buf
