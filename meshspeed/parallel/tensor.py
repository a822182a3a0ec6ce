"""Tensor parallelism (Megatron-style) with optional sequence parallelism.

Layers split their weights over the tensor-parallel group ("tp"):

    ColumnParallelLinear   weight [out/tp, in]   input copy_to        | gather_sp along seq (SP)
    RowParallelLinear      weight [out, in/tp]   output reduce_from   | reduce_scatter_sp (SP)
    VocabParallelEmbedding weight [V/tp, dim]    output reduce_from   | reduce_scatter_sp (SP)
    TensorParallelMoE      experts' hidden /tp   router replicated, one reduce for all experts
    SequenceParallelRMSNorm                      runs on the seq shard; weight grad all-reduced

With sequence parallelism the residual stream between those layers is [batch, seq/tp, dim]
(tp must divide seq). The output projection keeps the logits sharded along the vocabulary
([batch, seq, V/tp]) and `vocab_parallel_cross_entropy` takes them as they are.

`parallelize(model, mesh)` applies a `TensorPlan` (tensor_plan.py) to a single-device
Transformer. Sharded parameters keep their FQN and carry `_ms_placement = ("tp", dim)` and
`_ms_full_shape` (CONTRACTS.md §1), sliced from the initialised full weights (§3).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshspeed import comm
from meshspeed.models.layers import RMSNorm
from meshspeed.models.llama import cross_entropy_loss
from meshspeed.models.moe import MoE
from meshspeed.parallel.tensor_comm import (chunk_bounds, chunk_sizes, gather_chunks,
                                            gather_chunks_ad, shard, vocab_parallel_cross_entropy)
from meshspeed.parallel.tensor_plan import STYLES, TensorPlan, default_plan

__all__ = [
    "STYLES", "ColumnParallelLinear", "RowParallelLinear", "SequenceParallelRMSNorm",
    "TensorParallelMoE", "TensorPlan", "VocabParallelEmbedding", "check_tp", "chunk_bounds",
    "chunk_sizes", "default_plan", "full_grad", "full_tensor", "loss_fn", "model_loss",
    "parallelize", "shard_param", "vocab_parallel_cross_entropy",
]


def shard_param(full: torch.Tensor, dim: int, group: comm.Group) -> nn.Parameter:
    """This rank's torch.chunk piece of `full` along `dim`, tagged per CONTRACTS.md §1."""
    n = full.shape[dim]
    if min(chunk_sizes(n, group.size)) == 0:  # checked on every rank alike, so all raise
        ok = ", ".join(str(q) for q in range(1, group.size) if min(chunk_sizes(n, q)) > 0)
        raise comm.ConfigError(f"parallel.tp={group.size} leaves an empty torch.chunk piece of a "
                               f"{list(full.shape)} weight along dim {dim}; valid tp: {ok}")
    local = shard(full.detach(), dim, group)
    p = nn.Parameter(local.clone(), requires_grad=full.requires_grad)
    p._ms_placement = ("tp", dim)
    p._ms_full_shape = torch.Size(full.shape)
    return p


def full_tensor(t: torch.Tensor, group: comm.Group, placement: tuple | None,
                full_shape: torch.Size | None) -> torch.Tensor:
    """Gather a tensor laid out like a parameter with `placement` to its full shape (no grad)."""
    if placement is None or group.size == 1:
        return t
    dim = placement[1]
    return gather_chunks(t.detach(), group, dim, full_shape[dim])


def full_grad(param: nn.Parameter, group: comm.Group) -> torch.Tensor | None:
    """The full-shape gradient of a (possibly sharded) parameter; collective over tp."""
    if param.grad is None:
        return None
    return full_tensor(param.grad, group, getattr(param, "_ms_placement", None),
                       getattr(param, "_ms_full_shape", None))


def _check_seq(seq: int, group: comm.Group) -> None:
    if seq % group.size:
        raise comm.ConfigError(
            f"sequence parallelism needs the sequence length divisible by parallel.tp={group.size}, "
            f"got seq={seq}; pad the batch to a multiple of {group.size} or turn "
            "sequence_parallel off")


class ColumnParallelLinear(nn.Module):
    """y[..., out/tp] = x W_localᵀ: the output features split over tp.

    Input: replicated [batch, seq, in] (copy_to), or with sequence_parallel [batch, seq/tp, in]
    (gather_sp). Output: this rank's features [batch, seq, out/tp], or all of them when
    gather_output. `vocab_parallel` marks an output projection whose local logits feed
    vocab_parallel_cross_entropy.
    """

    def __init__(self, linear: nn.Linear, group: comm.Group, sequence_parallel: bool = False,
                 gather_output: bool = False, vocab_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.gather_output, self.vocab_parallel = gather_output, vocab_parallel
        self.in_features, self.full_out_features = linear.in_features, linear.out_features
        self.weight = shard_param(linear.weight, 0, group)
        self.bias = shard_param(linear.bias, 0, group) if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = comm.gather_sp(x, self.group, 1) if self.sequence_parallel else comm.copy_to(x, self.group)
        y = F.linear(x, self.weight, self.bias)  # [batch, seq, out/tp]
        return gather_chunks_ad(y, self.group, -1, self.full_out_features) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.full_out_features}/{self.group.size}, "
                f"sp={self.sequence_parallel}, vocab_parallel={self.vocab_parallel}")


class RowParallelLinear(nn.Module):
    """y = Σ_tp x[..., in/tp] W_localᵀ (+ bias once): the input features split over tp.

    Input [batch, seq, in/tp] from a column-parallel layer. Output replicated
    [batch, seq, out] (reduce_from), or with sequence_parallel [batch, seq/tp, out]
    (reduce_scatter_sp).
    """

    def __init__(self, linear: nn.Linear, group: comm.Group, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.full_in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = shard_param(linear.weight, 1, group)
        # Replicated, added after the reduction so it counts once.
        self.bias = nn.Parameter(linear.bias.detach().clone()) if linear.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)  # partial sums [batch, seq, out]
        if self.sequence_parallel:
            y = comm.reduce_scatter_sp(y, self.group, 1)
            # Each rank sees only its tokens: sum the bias gradient over tp (copy_to backward).
            return y if self.bias is None else y + comm.copy_to(self.bias, self.group)
        y = comm.reduce_from(y, self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in={self.full_in_features}/{self.group.size}, out={self.out_features}, "
                f"sp={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary rows split over tp (torch.chunk pieces).

    tokens [batch, seq] -> [batch, seq, dim] replicated, or [batch, seq/tp, dim] with
    sequence_parallel. Each rank looks up the tokens it owns, zeroes the rest by a mask
    multiply, and the partial embeddings are summed (reduce_from / reduce_scatter_sp).
    """

    def __init__(self, embedding: nn.Embedding, group: comm.Group, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        offs = chunk_bounds(self.num_embeddings, group.size)
        self.vocab_start, self.vocab_end = offs[group.rank], offs[group.rank + 1]
        self.weight = shard_param(embedding.weight, 0, group)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.vocab_start
        mask = (local >= 0) & (local < self.vocab_end - self.vocab_start)
        h = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        h = h * mask.unsqueeze(-1).to(h.dtype)  # partial [batch, seq, dim]
        if self.sequence_parallel:
            _check_seq(tokens.shape[1], self.group)
            return comm.reduce_scatter_sp(h, self.group, 1)
        return comm.reduce_from(h, self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}/{self.group.size}, {self.embedding_dim}, "
                f"rows=[{self.vocab_start}, {self.vocab_end}), sp={self.sequence_parallel}")


class SequenceParallelRMSNorm(RMSNorm):
    """RMSNorm on a [batch, seq/tp, dim] shard. Its weight is replicated but each rank sees
    only its tokens, so the weight enters through copy_to: the gradient is summed over tp
    inside backward, with no hook and no extra step for the optimizer."""

    def __init__(self, norm: RMSNorm, group: comm.Group):
        super().__init__(norm.weight.shape[0], norm.eps)
        self.group = group
        self.weight = norm.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * comm.copy_to(self.weight, self.group)


def _shard_linear_(linear: nn.Linear, dim: int, group: comm.Group) -> None:
    """Replace a plain nn.Linear's weight by its tp piece (no communication inside)."""
    linear.weight = shard_param(linear.weight, dim, group)
    if linear.bias is not None and dim == 0:
        linear.bias = shard_param(linear.bias, 0, group)
    if dim == 0:
        linear.out_features = linear.weight.shape[0]
    else:
        linear.in_features = linear.weight.shape[1]


class TensorParallelMoE(MoE):
    """MoE with each expert's hidden width (and the shared expert's) split over tp.

    Every rank routes all tokens with the replicated router (so routing, aux losses and
    tokens_per_expert equal the single-device ones), runs its hidden slice of every expert,
    and one reduce (reduce_from, or reduce_scatter_sp) sums the experts' partial outputs.
    Gradients: the routed and shared experts' input goes through copy_to (partial input
    gradients summed); the combine weights go through copy_to (each rank's output is partial,
    so its weight gradient is too); the router input itself is not summed (its gradient is
    already complete on every rank). Expert parallelism (experts split over ranks) is separate.
    """

    def __init__(self, moe: MoE, group: comm.Group, sequence_parallel: bool = False):
        nn.Module.__init__(self)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.n_experts, self.top_k = moe.n_experts, moe.top_k
        self.aux_loss_coef, self.z_loss_coef = moe.aux_loss_coef, moe.z_loss_coef
        self.router = moe.router
        self.experts = moe.experts
        for name, dim in (("w1", 1), ("w3", 1), ("w2", 2)):  # [E, hidden, dim] / [E, dim, hidden]
            setattr(self.experts, name, shard_param(getattr(self.experts, name), dim, group))
        self.shared_expert = moe.shared_expert
        if self.shared_expert is not None:
            for name, dim in (("w1", 0), ("w3", 0), ("w2", 1)):
                _shard_linear_(getattr(self.shared_expert, name), dim, group)
        self.load_balance_loss = self.z_loss = self.tokens_per_expert = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:  # [batch, seq/tp, dim] -> all tokens [batch, seq, dim]
            x = comm.gather_from(x, self.group, 1)
        shape = x.shape
        xr = x.reshape(-1, shape[-1])  # [tokens, dim], replicated
        weights, experts, logits = self.router(xr)
        counts = torch.bincount(experts.flatten(), minlength=self.n_experts)  # [n_experts]
        self._record_router(logits, counts)
        xe = comm.copy_to(xr, self.group)
        out = self.routed(xe, comm.copy_to(weights, self.group), experts, counts)  # partial
        if self.shared_expert is not None:
            out = out + self.shared_expert(xe)
        out = out.view(shape)
        if self.sequence_parallel:
            return comm.reduce_scatter_sp(out, self.group, 1)
        return comm.reduce_from(out, self.group)


# --- parallelize -------------------------------------------------------------------------

_BUILDERS = {
    "colwise": lambda m, g, sp: ColumnParallelLinear(m, g, sp),
    "rowwise": lambda m, g, sp: RowParallelLinear(m, g, sp),
    "colwise_vocab": lambda m, g, sp: ColumnParallelLinear(m, g, sp, vocab_parallel=True),
    "vocab_embedding": lambda m, g, sp: VocabParallelEmbedding(m, g, sp),
    "sequence_norm": lambda m, g, sp: SequenceParallelRMSNorm(m, g) if sp else m,
    "moe": lambda m, g, sp: TensorParallelMoE(m, g, sp),
    "replicate": lambda m, g, sp: m,
}


def _tp_group(mesh) -> comm.Group:
    return mesh if isinstance(mesh, comm.Group) else mesh["tp"]


def check_tp(tp: int, config) -> None:
    """One-line error when tp cannot split the attention heads."""
    ok = ", ".join(str(q) for q in range(1, config.n_heads + 1)
                   if config.n_heads % q == 0 and config.num_kv_heads % q == 0)
    for name, value in (("n_heads", config.n_heads), ("n_kv_heads", config.num_kv_heads)):
        if value % tp:
            raise comm.ConfigError(f"parallel.tp={tp} does not divide {name}={value}; valid tp: {ok}")


def parallelize(model: nn.Module, mesh, *, sequence_parallel: bool = False,
                plan: TensorPlan | dict | list | None = None) -> nn.Module:
    """Make a single-device Transformer (or pipeline stage of one) tensor parallel, in place.

    mesh: a comm.Mesh (its "tp" group is used) or the tp Group itself. plan: default_plan(
    model.config) unless given. Weights must already be initialised: shards are sliced from
    them. A no-op when tp == 1. Returns the model; `model.tp_plan` keeps the plan applied.
    """
    group = _tp_group(mesh)
    if group.size == 1:
        return model
    if any(hasattr(p, "_ms_placement") for p in model.parameters()):
        raise comm.ConfigError("parallelize: the model is already tensor parallel; pass the "
                               "single-device model")
    config = model.config
    check_tp(group.size, config)
    plan = TensorPlan.of(plan) if plan is not None else default_plan(config)
    for fqn, style in plan.assign(model):  # assign() validates the whole plan before any swap
        new = _BUILDERS[style](model.get_submodule(fqn), group, sequence_parallel)
        parent, _, name = fqn.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, name, new)
    if getattr(config, "tie_embeddings", False):
        model.tie_weights()  # both sides are split alike along the vocabulary: share the piece
    model.tp_plan = plan
    return model


# --- loss ----------------------------------------------------------------------------------

def loss_fn(model: nn.Module):
    """`(logits, targets, ignore_index=-100) -> mean CE` for the model's output layout:
    vocab-parallel when the output projection keeps vocab-sharded logits, else plain."""
    out = getattr(model, "output", None)
    if isinstance(out, ColumnParallelLinear) and out.vocab_parallel and not out.gather_output:
        group = out.group
        start = chunk_bounds(out.full_out_features, group.size)[group.rank]  # no host sync

        def vocab_parallel_loss(logits, targets, ignore_index: int = -100):
            return vocab_parallel_cross_entropy(logits, targets, group, ignore_index, start)

        return vocab_parallel_loss
    return cross_entropy_loss


def model_loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, *,
               ignore_index: int = -100, aux: bool = True) -> torch.Tensor:
    """Training loss of `model` on (tokens, targets) whatever its layout: mean next-token CE
    (+ the MoE auxiliary losses when aux). The same value on every tensor-parallel rank."""
    loss = loss_fn(model)(model(tokens), targets, ignore_index)
    return loss + model.aux_loss() if aux else loss
