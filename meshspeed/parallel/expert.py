"""Expert parallelism: the routed experts of an MoE layer split over an ep group.

Each ep member holds a block of experts (Shard(0) of the stacked [E, ...] weights, tagged
"ep" so checkpoints reshard across ep sizes) and its own tokens (ep ranks are data-parallel
ranks: different samples). Per layer:

  route (replicated router) -> sort slots by expert -> exchange counts -> all-to-all with
  uneven splits -> local experts (grouped matmul or loop) -> all-to-all back -> un-sort ->
  weight by router probabilities (+ shared expert, which needs no communication).

Dropless: every slot reaches its expert. A member that receives no tokens still joins both
all-to-alls (with zero rows) and its experts get zero gradients, so nothing hangs.

Gradients: expert gradients on a member are complete for the tokens of the whole ep group
(the backward all-to-all brings every source's contribution). Router, shared-expert and
input gradients are this member's tokens only, like any data-parallel gradient: the usual
dp reduction sums them. Expert gradients must only be reduced over the expert-data-parallel
group (members holding the same experts): see `expert_params`.

The alternative all-gather dispatcher gathers every member's tokens, runs the local experts
on the slots routed to them, and reduce-scatters partial outputs back (for small ep, where
all-to-all's split bookkeeping costs more than the extra bytes).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from meshspeed import comm
from meshspeed.comm.placement import Shard, shard_parameter, sharding_of

from . import expert_comm as xc
from . import expert_replicate as xr

DISPATCHERS = ("alltoall", "allgather")


class ExpertParallelMoE(nn.Module):
    """An MoE layer (meshspeed.models.moe.MoE, duck-typed: parallel never imports models) with
    its routed experts split over `group`. Same outputs and (after the dp reduction) the
    same gradients as the single-device layer on the concatenated tokens of all members."""

    def __init__(
        self, moe: nn.Module, group, dispatcher: str = "alltoall", capacity_factor: float | None = None
    ):
        super().__init__()
        if dispatcher not in DISPATCHERS:
            raise ValueError(f"moe.dispatcher={dispatcher!r} is not known; valid: {', '.join(DISPATCHERS)}")
        n_experts = moe.n_experts
        # An ep that leaves a member without experts is shard_tensor's one-line error (valid ep listed).
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"moe.capacity_factor={capacity_factor!r} must be > 0 (or unset: dropless)")
        if capacity_factor is not None and dispatcher != "alltoall":
            raise ValueError(f"moe.capacity_factor needs moe.dispatcher='alltoall', not {dispatcher!r}")
        self.group, self.dispatcher, self.capacity_factor = group, dispatcher, capacity_factor
        self.n_experts, self.top_k = n_experts, moe.top_k
        self.aux_loss_coef, self.z_loss_coef = moe.aux_loss_coef, moe.z_loss_coef
        self.router = moe.router
        self.experts = moe.experts
        for name in ("w1", "w2", "w3"):  # [E, ...] -> [local_experts, ...]
            setattr(self.experts, name, shard_parameter(getattr(self.experts, name), "ep", Shard(0), group))
        self.shared_expert = moe.shared_expert
        # moe.overlap_shared: same numbers either way; off only to measure what it hides
        self.overlap_shared = True
        self.bounds = xc.expert_bounds(n_experts, group.size)
        self.a2a_clock = xc.WaitClock()  # time blocked on this layer's exchanges (benchmarks)
        # moe.replicate_hot: copy hot experts onto the members routing to them (expert_replicate.py)
        self.replicate_hot, self.last_replicas, self.replication = 0, None, xr.ReplicationStats()
        self.load_balance_loss = self.z_loss = self.tokens_per_expert = self.step_counts = None
        # Reuse the single-device layer's loss bookkeeping (same formulas, this member's tokens).
        self._record_router = moe._record_router.__func__.__get__(self)
        self.aux_loss = moe.aux_loss.__func__.__get__(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [tokens, dim], this member's tokens
        weights, experts, logits = self.router(x)
        counts = torch.bincount(experts.flatten(), minlength=self.n_experts)  # [E]
        self._record_router(logits, counts)
        shared = None
        if self.dispatcher == "alltoall":
            out, shared = self._alltoall(x, weights, experts, counts)
        else:
            out = self._allgather(x, weights, experts)
        if self.shared_expert is not None:
            out = out + (self.shared_expert(x) if shared is None else shared)
        return out.view(shape)

    def _alltoall(self, x, weights, experts, counts) -> torch.Tensor:
        n_tokens, k = experts.shape
        flat = experts.flatten()
        order = flat.argsort(stable=True)  # [tokens*k] slots sorted by expert
        if self.capacity_factor is not None:
            order, counts = self._drop_overflow(order, flat, counts, n_tokens * k)
        all_counts = xc.exchange_counts(counts, self.group)  # [ep, E]
        order, local, copies = self._copies(all_counts, order, flat, counts)
        if copies is not None:
            all_counts = self.last_replicas.counts  # the copied runs are not dispatched
        send, recv, runs = xc.splits(all_counts, self.bounds, self.group.rank)
        # Slots sorted by expert are already grouped by destination member (experts are blocks).
        rows, shared = x[order // k], None
        if self.group.size > 1:
            # Posted, then awaited: what runs in between hides the exchange. The shared expert
            # needs no routing, so it runs there (moe.overlap_shared), and in backward while the
            # reverse exchange is in flight; inside an overlapped pipeline step the other
            # micro-batch's backward or forward runs there too (pipeline/duet.py).
            posted = xc.launch(rows, self.group, send, recv, self.a2a_clock)
            if self.overlap_shared and self.shared_expert is not None:
                shared = self.shared_expert(x)
            received = xc.land(posted, self.group, send, recv)  # [recv_total, dim]
        else:
            received = xc.dispatch(rows, self.group, send, recv)
        perm = xc.source_to_expert_order(runs)  # received row -> expert-major position
        y = self.experts(received[perm], runs.sum(0))  # [recv_total, dim], expert-major
        y = y[_inverse(perm)]  # back to source-major, as received
        if self.group.size > 1:  # [kept slots, dim] in `order`
            back = xc.launch(y, self.group, recv, send, self.a2a_clock)
            if copies is not None:  # the copied runs compute while the combine is in flight
                order = torch.cat([order, local])
                mine = self._on_copies(x[local // k], counts, *copies)
            y_sorted = xc.land(back, self.group, recv, send)
            if copies is not None:
                y_sorted = torch.cat([y_sorted, mine])
        else:
            y_sorted = xc.combine(y, self.group, send, recv)
        if self.capacity_factor is None:  # dropless: `order` is a permutation of the slots
            # (an index keeps only the indices for backward; index_copy would keep y_sorted)
            y = y_sorted[_inverse(order)]
        else:  # dropped slots stay zero (they pass through the residual only)
            y = y_sorted.new_zeros(n_tokens * k, y_sorted.shape[-1]).index_copy(0, order, y_sorted)
        y = y.view(n_tokens, k, -1)
        return (y * weights.unsqueeze(-1).to(y.dtype)).sum(dim=1), shared

    def _copies(self, all_counts, order, flat, counts):
        """moe.replicate_hot: plan the copies and post their weights. Returns (slots to
        dispatch, slots computed here on copies, None or (posted weight exchange, its splits,
        experts copied here, in slot order))."""
        if not self.replicate_hot or self.group.size == 1:
            return order, None, None
        rep = self.last_replicas = xr.plan(all_counts, self.bounds, self.replicate_hot)
        posted = None
        if rep.entries:  # sets rep.weight_bytes
            posted, (send, recv), here = xr.send_weights(
                self.experts, rep, self.group, self.bounds, self._launch
            )
        if torch.is_grad_enabled():  # the step's metrics count training forwards only
            self.replication.add(rep)
        if posted is None:
            return order, None, None
        on_copy = torch.isin(flat[order], torch.tensor(here, dtype=flat.dtype, device=flat.device))
        return order[~on_copy], order[on_copy], (posted, send, recv, here)

    def _launch(self, rows, group, send, recv):
        return xc.launch(rows, group, send, recv, self.a2a_clock)

    def _on_copies(self, x, counts, posted, send, recv, here):
        """x [copied slots, dim] sorted by expert -> their expert outputs, on the received copies."""
        w = xc.land(posted, self.group, send, recv)  # [copies here, numel]
        if not here:  # an empty slice still ties the exchange into the graph: its backward (the
            return w[:0, : x.shape[-1]]  # copies' gradients going home) runs on every member
        return xr.compute_copies(self.experts, w, len(here), x, counts[here])

    def _drop_overflow(self, order, flat_experts, counts, n_slots):
        """Keep the first `capacity` slots of each expert in token order (this rank's tokens,
        capacity = ceil(capacity_factor * slots / n_experts), as Switch/GShard); drop the rest."""
        cap = math.ceil(self.capacity_factor * n_slots / self.n_experts)
        se = flat_experts[order]  # expert of each sorted slot
        starts = torch.cumsum(counts, 0) - counts  # [E] first sorted position of each expert
        keep = torch.arange(order.numel(), device=order.device) - starts[se] < cap
        return order[keep], counts.clamp(max=cap)

    def _member_tokens(self, n_tokens: int) -> list[int]:
        """Tokens each member passes (the all-gather's sizes): every member's batch has one shape."""
        return [n_tokens] * self.group.size

    def _allgather(self, x, weights, experts) -> torch.Tensor:
        n_tokens, k = experts.shape
        sizes = self._member_tokens(n_tokens)
        xs = xc.gather_tokens(x, self.group, sizes)  # [all tokens, dim]
        ws = xc.gather_tokens(weights, self.group, sizes)  # [all tokens, k]
        es = xc.gather_tokens(experts, self.group, sizes) if self.group.size > 1 else experts
        lo, hi = self.bounds[self.group.rank], self.bounds[self.group.rank + 1]
        flat = es.flatten()
        mine = ((flat >= lo) & (flat < hi)).nonzero().squeeze(1)  # my slots, in slot order
        local_e = flat[mine] - lo
        order = local_e.argsort(stable=True)
        slots = mine[order]  # [my slots] sorted by local expert
        counts = torch.bincount(local_e, minlength=hi - lo)
        y = self.experts(xs[slots // k], counts) * ws.flatten()[slots].unsqueeze(-1).to(xs.dtype)
        out = torch.zeros_like(xs).index_add(0, slots // k, y)  # partial: my experts only
        return xc.reduce_tokens(out, self.group)


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def expert_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(expert parameters split over ep, all other parameters): the first list is reduced over
    the expert-data-parallel group (mesh "edp"), the second over the whole dp × cp group."""
    expert, other = [], []
    for p in model.parameters():
        s = sharding_of(p)
        (expert if s is not None and any(d == "ep" for d, _ in s.axes) else other).append(p)
    return expert, other


def expert_parallel(
    model: nn.Module, group, dispatcher: str = "alltoall", capacity_factor: float | None = None
) -> nn.Module:
    """Replace every MoE layer of `model` (modules with `experts` and `router`) in place by
    its ExpertParallelMoE over `group`; returns the model."""
    return replace_moe_layers(model, lambda m: ExpertParallelMoE(m, group, dispatcher, capacity_factor))


def replace_moe_layers(model: nn.Module, make) -> nn.Module:
    """Swap every MoE layer of `model` (a module with `experts` and `router` that is not already
    expert parallel) for make(layer), in place; returns the model."""
    targets = [
        (name, m)
        for name, m in model.named_modules()
        if hasattr(m, "experts") and hasattr(m, "router") and not isinstance(m, ExpertParallelMoE)
    ]
    for name, m in targets:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, make(m))
    return model


def sync_grads(model: nn.Module, mesh) -> None:
    """Plain (unbucketed) gradient reduction for an expert-parallel model whose ranks each took
    the mean loss of their own tokens: the result is the gradient of the mean over all dp × cp
    ranks. Other parameters: average over "dp_cp". Expert parameters already hold the sum over
    their ep group's tokens, so they are summed over "edp" (the ranks holding the same experts)
    and divided by the dp × cp size. DataParallel/ZeRO over "edp" is the bucketed equivalent."""
    expert, other = expert_params(model)
    dp_cp = mesh["dp_cp"]
    for p in other:
        if p.grad is not None:
            comm.all_reduce(p.grad, dp_cp, op="avg")
    for p in expert:
        if p.grad is not None:
            comm.all_reduce(p.grad, mesh["edp"], op="sum")
            p.grad.div_(dp_cp.size)
