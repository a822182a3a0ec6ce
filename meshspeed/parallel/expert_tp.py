"""Expert parallelism under tensor parallelism: the three ways the tp ranks hold experts.

With tp > 1 the non-expert weights stay tp-sharded and the tokens reaching an MoE layer are
replicated over tp (sequence-sharded under SP, then gathered here: the router and the tp-split
shared expert both want all of them). Each MoE layer becomes this rank's ExpertParallelMoE
over mesh["ep"] in one of three modes:

  split  (etp = tp)      each expert's w1/w3 column-split and w2 row-split over tp, inside the
                         ep block: every tp rank dispatches all tokens over its ep group (the
                         peers with its tp index) and gets partial outputs (its hidden slice);
                         one reduce over tp sums them (Megatron-Core's etp = tp).
  tokens (etp = 1)       whole experts (the ep block) on every tp rank; the tp ranks of a replica
                         split the tokens (rank t takes chunk t) so none is computed twice.
                         Expert gradients then cover 1/tp of the tokens, so the mesh's edp group
                         spans tp (comm/mesh.py) and the data-parallel reduction sums them.
  fold   (tp_extend_ep)  the ep group is ep × tp ranks (member j·tp + t), experts split over all
                         of them, tokens split over tp as in `tokens` (MindSpeed's choice: whole
                         experts, so no tiny hidden/tp matmuls).

Why tokens/fold return a partial [tokens, dim] (this rank's rows, zeros elsewhere) and reduce it
rather than all-gathering the rows: the tp-split shared expert already leaves a partial output
that needs that reduce over tp (all-reduce, or reduce-scatter under SP, as TensorParallelMoE),
so the routed rows ride in the same collective, and under SP the reduce-scatter lands each
rank's sequence shard directly. One code path for all modes, SP or not.

Gradients: the router runs on all tokens on every tp rank, so its gradient and the aux/z-losses
are complete and replicated (the same as one rank holding this replica's tokens). The routed
input and combine weights enter through copy_to (split: partial input gradients, summed) or
split_to (tokens/fold: each rank's chunk complete, all-gathered in backward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshspeed import comm
from meshspeed.comm.algorithms import bounds
from meshspeed.comm.placement import Shard, full_tensor, shard_parameter, sharding_of

from .expert import ExpertParallelMoE, replace_moe_layers

MODES = ("split", "tokens", "fold")


def _split_over_tp(p: torch.Tensor) -> bool:
    s = sharding_of(p)
    return s is not None and any(d == "tp" for d, _ in s.axes)


def _whole(p: nn.Parameter, tp) -> nn.Parameter:
    """The whole expert weight from its tp piece (TensorParallelMoE split it): free on the meta
    device, an all-gather over tp on a real one (once, at build time)."""
    s = sharding_of(p)
    if [d for d, _ in s.axes] != ["tp"]:
        raise ValueError(f"expert weight {s} must be split over tp alone to be made whole")
    full = (
        torch.empty(s.full_shape, dtype=p.dtype, device="meta") if p.is_meta else full_tensor(p, {"tp": tp})
    )
    return nn.Parameter(full, requires_grad=p.requires_grad)


def _tp_split(module: nn.Module, name: str, dim: int, tp) -> None:
    setattr(module, name, shard_parameter(getattr(module, name), "tp", Shard(dim), tp))
    if isinstance(module, nn.Linear):  # keep the Linear's own description true
        module.out_features, module.in_features = module.weight.shape


class ExpertTensorParallelMoE(ExpertParallelMoE):
    """An MoE layer (single-device, or TensorParallelMoE's tp split) with its routed experts over
    `ep_group` and `tp` used as `mode` says (module docstring). The shared expert is split over
    tp as under plain tensor parallelism. Outputs: replicated over tp, or the [batch, seq/tp,
    dim] shard under sequence_parallel; equal to the single-device layer on this replica's
    tokens, and so are the gradients after the (expert-)data-parallel reduction."""

    def __init__(
        self,
        moe: nn.Module,
        ep_group,
        tp,
        mode: str,
        sequence_parallel: bool = False,
        dispatcher: str = "alltoall",
        capacity_factor: float | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"expert tp mode {mode!r} is not known; valid: {', '.join(MODES)}")
        if capacity_factor is not None and mode != "split":
            # capacity counts a rank's own slots; with tokens split over tp that is 1/tp of them
            raise ValueError(f"moe.capacity_factor needs the experts split over tp (etp = tp), not {mode!r}")
        experts = moe.experts
        for name, dim in (("w1", 1), ("w3", 1), ("w2", 2)):  # [E, hidden, dim] / [E, dim, hidden]
            w = getattr(experts, name)
            if mode == "split" and not _split_over_tp(w):
                _tp_split(experts, name, dim, tp)
            elif mode != "split" and _split_over_tp(w):
                setattr(experts, name, _whole(w, tp))
        if moe.shared_expert is not None:
            for name, dim in (("w1", 0), ("w3", 0), ("w2", 1)):
                lin = getattr(moe.shared_expert, name)
                if not _split_over_tp(lin.weight):
                    _tp_split(lin, "weight", dim, tp)
        super().__init__(moe, ep_group, dispatcher, capacity_factor)  # then split over ep: Shard(0)
        self.tp, self.mode, self.sequence_parallel = tp, mode, sequence_parallel
        self._sizes: list[int] = []

    # The parent overlaps the shared expert with the dispatch on the rows it dispatches: right
    # for `split` (all tokens), not for tokens/fold (a chunk; the shared expert needs them all).
    @property
    def overlap_shared(self) -> bool:
        return self._overlap and self.mode == "split"

    @overlap_shared.setter
    def overlap_shared(self, value: bool) -> None:
        self._overlap = bool(value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp = self.tp
        if self.sequence_parallel:  # [batch, seq/tp, dim] -> [batch, seq, dim]
            x = comm.gather_from(x, tp, 1)
        shape = x.shape
        xr = x.reshape(-1, shape[-1])  # [tokens, dim], the same on every tp rank
        weights, experts, logits = self.router(xr)
        counts = torch.bincount(experts.flatten(), minlength=self.n_experts)  # [E]
        self._record_router(logits, counts)
        xe = comm.copy_to(xr, tp)  # the shared expert's (and split's) input: partial gradients
        if self.mode == "split":
            out, shared = self._routed(xe, comm.copy_to(weights, tp), experts, counts)  # partial
        else:
            n = xr.shape[0]
            offs = bounds(n, tp.size)  # split_to's chunks
            lo, hi = offs[tp.rank], offs[tp.rank + 1]
            self._sizes = [offs[t + 1] - offs[t] for t in range(tp.size)]
            mine = experts[lo:hi]
            rows, _ = self._routed(
                comm.split_to(xr, tp, 0),
                comm.split_to(weights, tp, 0),
                mine,
                torch.bincount(mine.flatten(), minlength=self.n_experts),
            )
            out, shared = F.pad(rows, (0, 0, lo, n - hi)), None  # partial: this rank's rows
        if self.shared_expert is not None:
            out = out + (self.shared_expert(xe) if shared is None else shared)
        out = out.view(shape)
        if self.sequence_parallel:
            return comm.reduce_scatter_sp(out, tp, 1)
        return comm.reduce_from(out, tp)

    def _routed(self, x, weights, experts, counts) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The parent's dispatch -> experts -> combine on these slots: (output, shared expert's
        output when it overlapped it with the dispatch, else None)."""
        if self.dispatcher == "alltoall":
            return self._alltoall(x, weights, experts, counts)
        return self._allgather(x, weights, experts), None

    def _member_tokens(self, n_tokens: int) -> list[int]:
        if self.mode == "fold":  # member j·tp + t passes chunk t of its replica's tokens
            return self._sizes * (self.group.size // self.tp.size)
        return super()._member_tokens(n_tokens)

    def extra_repr(self) -> str:
        return f"mode={self.mode}, ep={self.group.size}, tp={self.tp.size}, sp={self.sequence_parallel}"


def expert_tensor_parallel(
    model: nn.Module,
    ep_group,
    tp,
    mode: str,
    sequence_parallel: bool = False,
    dispatcher: str = "alltoall",
    capacity_factor: float | None = None,
) -> nn.Module:
    """Replace every MoE layer of `model` (modules with `experts` and `router`; single-device or
    already tensor parallel) in place by its ExpertTensorParallelMoE; returns the model.
    ep_group: mesh["ep"] (ep × tp ranks for `fold`), tp: mesh["tp"]."""
    args = (ep_group, tp, mode, sequence_parallel, dispatcher, capacity_factor)
    return replace_moe_layers(model, lambda m: ExpertTensorParallelMoE(m, *args))
