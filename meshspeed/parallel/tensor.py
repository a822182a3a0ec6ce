"""Tensor parallelism (Megatron-style) with optional sequence parallelism, for any model
whose recipe (comm/recipe.py) gives a tensor-parallel plan.

Built-in styles split torch's own modules over the tensor-parallel group ("tp"):

    colwise          ColumnParallelLinear    weight [out/tp, in]  input copy_to | gather_sp (SP)
    rowwise          RowParallelLinear       weight [out, in/tp]  output reduce_from | reduce_scatter_sp
    colwise_vocab    ColumnParallelLinear    logits kept vocab-sharded for vocab_parallel_cross_entropy
    vocab_embedding  VocabParallelEmbedding  weight [V/tp, dim]   output reduce_from | reduce_scatter_sp
    sequence_norm    SequenceParallel        any per-token module runs on the seq shard under SP
    replicate        left as is

A family adds its own styles (its MoE layer, say) in its recipe. With sequence parallelism the
residual stream between those layers is [batch, seq/tp, dim] (tp must divide seq): the token
embedding's reduce-scatter cuts it, or, for a family whose embedding must see the whole sequence
(a vlm's image features scattered into it), the output of the recipe's `sp_split` module. The output
projection keeps the logits sharded along the vocabulary ([batch, seq, V/tp]) and
`vocab_parallel_cross_entropy` takes them as they are.

`parallelize(model, mesh, recipe)` applies the plan in place. It works on a model still on the
meta device (parameters born sharded: materialize.py fills each piece afterwards) as well as on
an initialised one. Sharded parameters keep their FQN and carry a comm.placement.Sharding.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from meshspeed import comm
from meshspeed.comm.placement import Shard, chunk_bounds, shard_parameter
from meshspeed.comm.recipe import Recipe, Style, tie
from meshspeed.kernels.loss import cross_entropy_loss
from meshspeed.parallel.tensor_comm import (
    gather_chunks_ad,
    split_sequence_after,
    vocab_parallel_cross_entropy,
    vocab_parallel_token_ce,
)
from meshspeed.parallel.tensor_plan import TensorPlan
from meshspeed.parallel.tp_overlap import chunks_for, column_sp, row_sp

__all__ = [
    "STYLES",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "SequenceParallel",
    "TensorPlan",
    "VocabParallelEmbedding",
    "check_tp",
    "loss_fn",
    "model_loss",
    "parallelize",
    "set_tp_overlap",
    "tp_plan",
    "vocab_parallel_cross_entropy",
]


def _shard(p: torch.Tensor, dim: int, group: comm.Group) -> nn.Parameter:
    return shard_parameter(p, "tp", Shard(dim), group)


def _check_seq(seq: int, group: comm.Group) -> None:
    if seq % group.size:
        raise comm.ConfigError(
            f"sequence parallelism needs the sequence length divisible by parallel.tp={group.size}, "
            f"got seq={seq}; pad the batch to a multiple of {group.size} or turn "
            "sequence_parallel off"
        )


# Per tp group: the last SP gather — (its input, weakly; the input's version; grad mode; the
# gathered tensor). Sibling projections — q, k and v, or gate and up — read the same normed
# activations, and under SP each would all-gather them and reduce-scatter its gradient on its
# own: three (or two) collectives each way where one suffices. The gathered tensor is reused
# for the same unchanged input in the same grad mode, so autograd sums the siblings' gradients
# into it and its one reduce-scatter runs once. It is held only as long as its input lives
# (a finalizer on the input drops it), so nothing outlives the block that made it, and the
# reuse is the same whether the matmuls keep it for backward or a recompute discards it.
_SP_GATHERED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _forget(group_ref, src) -> None:
    """x's finalizer: drop the group's entry if it is still the one made for x."""
    group = group_ref()
    entry = _SP_GATHERED.get(group) if group is not None else None
    if entry is not None and entry[0] is src:
        del _SP_GATHERED[group]


def _gather_once(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    if torch.compiler.is_compiling():
        # dynamo cannot trace weak references: one traceable gather per reader (comm.gather_sp's
        # compiled form); the eager memo below is unchanged
        return comm.gather_sp(x, group, 1)
    last = _SP_GATHERED.get(group)
    if last is not None:
        src, version, grad, y = last
        if src() is x and version == x._version and grad == torch.is_grad_enabled():
            return y
    y = comm.gather_sp(x, group, 1)
    src = weakref.ref(x)
    _SP_GATHERED[group] = (src, x._version, torch.is_grad_enabled(), y)
    weakref.finalize(x, _forget, weakref.ref(group), src)
    return y


class ColumnParallelLinear(nn.Module):
    """y[..., out/tp] = x W_localᵀ: the output features split over tp.

    Input: replicated [batch, seq, in] (copy_to), or with sequence_parallel [batch, seq/tp, in]
    (gather_sp). Output: this rank's features [batch, seq, out/tp], or all of them when
    gather_output. `vocab_parallel` marks an output projection whose local logits feed
    vocab_parallel_cross_entropy.
    """

    ms_traceable = True  # its collectives compile (comm/traceable.py): train.compile keeps it in the graph

    def __init__(
        self,
        linear: nn.Linear,
        group: comm.Group,
        sequence_parallel: bool = False,
        gather_output: bool = False,
        vocab_parallel: bool = False,
    ):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.gather_output, self.vocab_parallel = gather_output, vocab_parallel
        self.in_features, self.full_out_features = linear.in_features, linear.out_features
        self.weight = _shard(linear.weight, 0, group)
        self.bias = _shard(linear.bias, 0, group) if linear.bias is not None else None
        self.tp_overlap, self.tp_overlap_chunks = False, None  # set_tp_overlap
        self.tp_overlap_auto: dict = {}  # input shape -> the cost model's K (tp_overlap.chunks_for)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # K = 1 hides nothing: the plain path below, not a one-chunk pipeline with its copies.
        # Compiled, the plain path too: its collectives are traceable, tp_overlap's are not.
        if (
            self.sequence_parallel
            and self.tp_overlap
            and not torch.compiler.is_compiling()
            and (k := chunks_for(self, x, "column")) > 1
        ):
            y = column_sp(x, self.weight, self.group, k)  # [batch, seq, out/tp]
            y = y if self.bias is None else y + self.bias
            return gather_chunks_ad(y, self.group, -1, self.full_out_features) if self.gather_output else y
        x = _gather_once(x, self.group) if self.sequence_parallel else comm.copy_to(x, self.group)
        y = F.linear(x, self.weight, self.bias)  # [batch, seq, out/tp]
        return gather_chunks_ad(y, self.group, -1, self.full_out_features) if self.gather_output else y

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.full_out_features}/{self.group.size}, "
            f"sp={self.sequence_parallel}, vocab_parallel={self.vocab_parallel}"
        )


class RowParallelLinear(nn.Module):
    """y = Σ_tp x[..., in/tp] W_localᵀ (+ bias once): the input features split over tp.

    Input [batch, seq, in/tp] from a column-parallel layer. Output replicated
    [batch, seq, out] (reduce_from), or with sequence_parallel [batch, seq/tp, out]
    (reduce_scatter_sp).
    """

    ms_traceable = True  # its collectives compile (comm/traceable.py): train.compile keeps it in the graph

    def __init__(self, linear: nn.Linear, group: comm.Group, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.full_in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = _shard(linear.weight, 1, group)
        # Replicated, added after the reduction so it counts once.
        self.bias = nn.Parameter(linear.bias.detach().clone()) if linear.bias is not None else None
        self.tp_overlap, self.tp_overlap_chunks = False, None  # set_tp_overlap
        self.tp_overlap_auto: dict = {}  # input shape -> the cost model's K (tp_overlap.chunks_for)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            overlap = self.tp_overlap and not torch.compiler.is_compiling()
            if overlap and (k := chunks_for(self, x, "row")) > 1:
                y = row_sp(x, self.weight, self.group, k)  # [batch, seq/tp, out]
            else:
                y = comm.reduce_scatter_sp(F.linear(x, self.weight), self.group, 1)
            # Each rank sees only its tokens: sum the bias gradient over tp (copy_to backward).
            return y if self.bias is None else y + comm.copy_to(self.bias, self.group)
        y = comm.reduce_from(F.linear(x, self.weight), self.group)  # partial sums summed
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in={self.full_in_features}/{self.group.size}, out={self.out_features}, "
            f"sp={self.sequence_parallel}"
        )


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary rows split over tp (torch.chunk pieces).

    tokens [batch, seq] -> [batch, seq, dim] replicated, or [batch, seq/tp, dim] with
    sequence_parallel. Each rank looks up the tokens it owns, zeroes the rest by a mask
    multiply, and the partial embeddings are summed (reduce_from / reduce_scatter_sp).
    """

    ms_traceable = True  # its collectives compile (comm/traceable.py): train.compile keeps it in the graph

    def __init__(self, embedding: nn.Embedding, group: comm.Group, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        offs = chunk_bounds(self.num_embeddings, group.size)
        self.vocab_start, self.vocab_end = offs[group.rank], offs[group.rank + 1]
        self.weight = _shard(embedding.weight, 0, group)

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
        return (
            f"{self.num_embeddings}/{self.group.size}, {self.embedding_dim}, "
            f"rows=[{self.vocab_start}, {self.vocab_end}), sp={self.sequence_parallel}"
        )


class SequenceParallel(nn.Module):
    """Runs a per-token module (a norm) on a [batch, seq/tp, dim] shard. Its parameters are
    replicated but each rank sees only its tokens, so they enter the wrapped module through
    copy_to: the gradient is summed over tp inside backward, with no hook and no extra step.

    The wrapped module is held outside the module tree and its parameters are registered here
    under their own names, so FQNs (`norm.weight`), checkpoints and the init are unchanged."""

    ms_traceable = True  # its collectives compile (comm/traceable.py): train.compile keeps it in the graph

    def __init__(self, module: nn.Module, group: comm.Group):
        super().__init__()
        if any(True for _ in module.children()):
            raise comm.ConfigError(
                f"sequence_norm applies to leaf modules (a norm); {type(module).__name__} "
                "has submodules: point the plan entry at the leaf"
            )
        self.group = group
        object.__setattr__(self, "inner", module)  # not a child: its FQN prefix would change
        for name, p in module.named_parameters(recurse=False):
            self.register_parameter(name, p)

    def forward(self, x: torch.Tensor, *args):
        # *args: a norm's residual (models' RMSNorm(x, residual)), sharded like x
        params = {n: comm.copy_to(p, self.group) for n, p in self._parameters.items() if p is not None}
        return torch.func.functional_call(self.inner, params, (x, *args))

    def extra_repr(self) -> str:
        return f"{self.inner!r}, sp over {self.group.size}"


# --- parallelize -------------------------------------------------------------------------

STYLES: dict[str, Style] = {
    "colwise": Style(
        nn.Linear,
        "output features split; input copied (all-gathered along seq with SP)",
        lambda m, g, sp: ColumnParallelLinear(m, g, sp),
    ),
    "rowwise": Style(
        nn.Linear,
        "input features split; output summed (reduce-scattered along seq with SP)",
        lambda m, g, sp: RowParallelLinear(m, g, sp),
    ),
    "colwise_vocab": Style(
        nn.Linear,
        "logits split over the vocabulary, kept sharded for the vocab-parallel cross-entropy",
        lambda m, g, sp: ColumnParallelLinear(m, g, sp, vocab_parallel=True),
    ),
    "vocab_embedding": Style(
        nn.Embedding,
        "rows split over the vocabulary; output summed (reduce-scattered along seq with SP)",
        lambda m, g, sp: VocabParallelEmbedding(m, g, sp),
    ),
    "sequence_norm": Style(
        nn.Module,
        "per-token module on the seq/tp shard with SP; replicated without",
        lambda m, g, sp: SequenceParallel(m, g) if sp else m,
    ),
    "replicate": Style(nn.Module, "left as is, with its whole subtree", lambda m, g, sp: m),
}


def _tp_group(mesh) -> comm.Group:
    return mesh if isinstance(mesh, comm.Group) else mesh["tp"]


def check_tp(tp: int, recipe: Recipe) -> None:
    """One-line error when tp cannot split what the recipe says it must divide (heads...)."""
    if not recipe.tp_divides:
        return
    top = max(recipe.tp_divides.values())
    ok = ", ".join(str(q) for q in range(1, top + 1) if all(v % q == 0 for v in recipe.tp_divides.values()))
    for name, value in recipe.tp_divides.items():
        if value % tp:
            raise comm.ConfigError(f"parallel.tp={tp} does not divide {name}={value}; valid tp: {ok}")


def tp_plan(recipe: Recipe, plan=None) -> TensorPlan:
    """The recipe's plan (or `plan` instead) with the built-in styles plus the recipe's own."""
    return TensorPlan.of(plan if plan is not None else recipe.tp_plan, {**STYLES, **recipe.tp_styles})


def parallelize(
    model: nn.Module,
    mesh,
    recipe: Recipe,
    *,
    sequence_parallel: bool = False,
    plan: TensorPlan | dict | list | None = None,
    tp_overlap: bool = False,
    tp_overlap_chunks: int | None = None,
) -> nn.Module:
    """Make a single-device model (or a pipeline stage of one) tensor parallel, in place.

    mesh: a comm.Mesh (its "tp" group is used) or the tp Group itself. plan: the recipe's
    unless given. The model may still be on the meta device (then only shapes and tags are
    made; materialize.py fills the pieces) or hold initialised weights (sliced). A no-op when
    tp == 1. Returns the model; `model.ms_tp_plan` keeps the plan applied. tp_overlap: see
    set_tp_overlap (sequence parallelism only). With sequence_parallel, the recipe's sp_split
    module runs whole and its output is cut to seq/tp (split_sequence_after); without one, the
    token embedding's reduce-scatter cuts.
    """
    group = _tp_group(mesh)
    if group.size == 1:
        return model
    if any(comm.placement.sharding_of(p) is not None for p in model.parameters()):
        raise comm.ConfigError(
            "parallelize: the model is already tensor parallel; pass the single-device model"
        )
    check_tp(group.size, recipe)
    plan = tp_plan(recipe, plan)
    # recipe.sp_split: what runs inside that module sees the whole sequence (built as without
    # SP: replicated activations, reduce_from), and only its output is cut to seq/tp
    whole = recipe.sp_split if sequence_parallel else None
    for fqn, style in plan.assign(model):  # assign() validates the whole plan before any swap
        sp = sequence_parallel and not (whole and (fqn == whole or fqn.startswith(whole + ".")))
        new = plan.styles[style].build(model.get_submodule(fqn), group, sp)
        parent, _, name = fqn.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, name, new)
    if whole:
        split_sequence_after(model, whole, group)
    tie(model, recipe)  # both sides of a tie are split alike (the vocabulary): share the piece
    model.ms_tp_plan = plan  # not `tp_plan`: transformers' models own that name (a dict property)
    if tp_overlap:
        set_tp_overlap(model, True, tp_overlap_chunks)
    return model


def set_tp_overlap(model: nn.Module, enabled: bool = True, chunks: int | None = None) -> int:
    """Overlap the sequence-parallel all-gathers / reduce-scatters of every column- and
    row-parallel linear in `model` with their matmuls (tp_overlap.py), or turn it off.
    chunks: K pieces per rank's sequence block; None picks K per layer from the cost model.
    Has no effect on layers without sequence parallelism. Returns the layers switched."""
    if chunks is not None and chunks < 1:
        raise comm.ConfigError(
            f"parallel.tp_overlap_chunks={chunks} must be at least 1; leave it unset to let the "
            "cost model choose"
        )
    n = 0
    for m in model.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.sequence_parallel:
            m.tp_overlap, m.tp_overlap_chunks = enabled, chunks
            n += 1
    return n


# --- loss ----------------------------------------------------------------------------------


def loss_fn(model: nn.Module, plain=cross_entropy_loss):
    """`(logits, targets, ignore_index=-100) -> mean CE` for the model's output layout:
    vocab-parallel when a projection keeps vocab-sharded logits, else `plain`."""
    out = next((m for m in model.modules() if isinstance(m, ColumnParallelLinear) and m.vocab_parallel), None)
    if out is not None and not out.gather_output:
        group = out.group
        start = chunk_bounds(out.full_out_features, group.size)[group.rank]  # no host sync

        def vocab_parallel_loss(logits, targets, ignore_index: int = -100):
            return vocab_parallel_cross_entropy(logits, targets, group, ignore_index, start)

        vocab_parallel_loss.vocab_parallel = True  # memory.chunked_loss's fused head knows it
        return vocab_parallel_loss
    return plain


def token_ce_fn(model: nn.Module):
    """`(logits, targets, ignore_index=-100) -> per-token CE [batch, seq]` (0 where ignored) for
    the model's output layout: vocab-parallel when the head keeps vocab-sharded logits. Sequence
    log-probabilities (preference objectives) are minus its sums."""
    out = next((m for m in model.modules() if isinstance(m, ColumnParallelLinear) and m.vocab_parallel), None)
    if out is not None and not out.gather_output:
        group = out.group
        start = chunk_bounds(out.full_out_features, group.size)[group.rank]

        def vocab_parallel(logits, targets, ignore_index: int = -100):
            return vocab_parallel_token_ce(logits, targets, group, ignore_index, start)

        return vocab_parallel
    return plain_token_ce


def plain_token_ce(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Per-token cross-entropy in float32 (0 where ignored), [batch, seq]."""
    flat = torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        targets.reshape(-1),
        ignore_index=ignore_index,
        reduction="none",
    )
    return flat.view(targets.shape)


def model_loss(
    model: nn.Module,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    aux: bool = True,
    plain=cross_entropy_loss,
) -> torch.Tensor:
    """Training loss of `model` on (tokens, targets) whatever its layout: mean next-token CE
    (+ the MoE auxiliary losses when aux). The same value on every tensor-parallel rank."""
    loss = loss_fn(model, plain)(model(tokens), targets, ignore_index)
    return loss + model.aux_loss() if aux else loss
