"""Token exchange for expert parallelism: counts, then rows with uneven splits, with autograd.

Every byte goes through meshspeed.comm. The counts exchange is one all-gather of each rank's
[n_experts] histogram, so every member knows every (source, expert) run length and the
splits of both directions are computed locally, identically on every member (no second
exchange for the backward: the reverse all-to-all swaps the splits).

`launch` / `land` split an exchange in two, like comm.all_to_all_start / all_to_all_wait, and
add two things the pipeline's forward-backward overlap needs: a hand-over (pipeline/duet.py)
right before each wait, forward and backward, so an independent backward or forward computes
while the rows are on the wire; and the time spent blocked in those waits, per layer, so what
the overlap hides is measured rather than guessed.
"""

from __future__ import annotations

import time

import torch

from meshspeed import comm
from meshspeed.comm.placement import chunk_bounds
from meshspeed.parallel.pipeline.duet import hand_over


def expert_bounds(n_experts: int, ep: int) -> list[int]:
    """Expert index where each ep member's block starts (and the end): torch.chunk layout,
    the same as Shard(0) of the stacked expert weights."""
    return chunk_bounds(n_experts, ep)


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """counts [n_experts] (this rank's routed slots per expert) -> [ep, n_experts], row j from
    member j. One small all-gather; the result has no gradient."""
    if group.size == 1:
        return counts.view(1, -1)
    return comm.all_gather(counts.contiguous().view(1, -1), group, 0)


def splits(
    all_counts: torch.Tensor, bounds: list[int], rank: int
) -> tuple[list[int], list[int], torch.Tensor]:
    """From [ep, E] counts: rows this rank sends to each member, rows it receives from each,
    and the [ep, local_experts] run lengths of what it receives (source-major)."""
    ep = all_counts.shape[0]
    # one host sync per layer: all-to-all split lists are Python ints
    per_dest = torch.stack(
        [all_counts[:, bounds[j] : bounds[j + 1]].sum(1) for j in range(ep)], 1
    )  # [src, dst]
    send = per_dest[rank].tolist()
    recv = per_dest[:, rank].tolist()
    runs = all_counts[:, bounds[rank] : bounds[rank + 1]]  # [ep, local_experts]
    return send, recv, runs


def source_to_expert_order(runs: torch.Tensor) -> torch.Tensor:
    """Permutation taking received rows (source-major, expert-sorted within each source) to
    expert-major order (source order kept within each expert): the grouped matmul needs one
    contiguous run per local expert. runs [ep, local_experts]."""
    ep, n_local = runs.shape
    seg = torch.arange(ep * n_local, device=runs.device)
    seg_of_row = torch.repeat_interleave(seg, runs.flatten())  # [rows], segment id = src*n_local + e
    key = (seg_of_row % n_local) * ep + seg_of_row // n_local  # expert-major key
    return key.argsort(stable=True)


def dispatch(x: torch.Tensor, group, send: list[int], recv: list[int]) -> torch.Tensor:
    """Rows of x [slots, dim] (grouped by destination member) -> rows received [recv_total, dim].
    Backward: the reverse all-to-all of the gradient."""
    return comm.all_to_all_ad(x, group, send, recv)


def combine(y: torch.Tensor, group, send: list[int], recv: list[int]) -> torch.Tensor:
    """Inverse of dispatch: expert outputs [recv_total, dim] back to their source ranks."""
    return comm.all_to_all_ad(y, group, recv, send)


def gather_tokens(x: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    """All-gather dispatcher: every member's tokens [tokens_j, dim] -> [sum tokens, dim];
    backward keeps this member's gradient rows after summing over members (each member's
    partial expert outputs contribute to every token)."""
    return comm.gather_sp(x, group, 0, sizes)


def reduce_tokens(y: torch.Tensor, group) -> torch.Tensor:
    """All-gather dispatcher's combine: partial outputs [sum tokens, dim] summed over members,
    this member's rows kept (reduce-scatter; all-gather of the gradient backward)."""
    return comm.reduce_scatter_sp(y, group, 0)


class WaitClock:
    """Seconds blocked waiting for exchanges (forward and backward) and how many waits."""

    def __init__(self) -> None:
        self.seconds, self.waits = 0.0, 0

    def wait(self, handle) -> torch.Tensor:
        hand_over()  # the other side of an overlapped step computes while this is in flight
        t0 = time.perf_counter()
        out = handle.wait()
        self.seconds += time.perf_counter() - t0
        self.waits += 1
        return out


class _Flight:
    def __init__(self, clock: WaitClock):
        self.clock, self.fwd, self.bwd = clock, None, None


class _Launch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, in_splits, out_splits, flight):
        ctx.flight = flight
        flight.fwd = comm.all_to_all(x, group, in_splits, out_splits, async_op=True)
        return x.new_empty(0)  # a token: orders the land after the launch in the graph

    @staticmethod
    def backward(ctx, _token):
        g = ctx.flight.clock.wait(ctx.flight.bwd)
        ctx.flight.bwd = None
        return g, None, None, None, None


class _Land(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token, group, in_splits, out_splits, flight):
        ctx.group, ctx.in_splits, ctx.out_splits, ctx.flight = group, in_splits, out_splits, flight
        out = flight.clock.wait(flight.fwd)
        flight.fwd = None
        return out

    @staticmethod
    def backward(ctx, g):
        # Post the reverse exchange and return: autograd runs the nodes recorded between launch
        # and land (the shared expert), then the launch's backward hands over and waits.
        f = ctx.flight
        f.bwd = comm.all_to_all(g.contiguous(), ctx.group, ctx.out_splits, ctx.in_splits, async_op=True)
        return g.new_zeros(0), None, None, None, None


def launch(x: torch.Tensor, group, send: list[int], recv: list[int], clock: WaitClock):
    """Post the exchange of rows x (send[j] rows to member j, recv[j] from j; group of 2 or
    more); returns a handle for `land`. Compute placed in between runs while it is in flight."""
    flight = _Flight(clock)
    return _Launch.apply(x, group, send, recv, flight), flight


def land(posted, group, send: list[int], recv: list[int]) -> torch.Tensor:
    """The rows `launch`'s exchange delivered. Same values and gradients as all_to_all_ad."""
    token, flight = posted
    return _Land.apply(token, group, send, recv, flight)
