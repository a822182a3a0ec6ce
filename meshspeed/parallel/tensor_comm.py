"""Communication for tensor parallelism beside meshspeed.comm.autograd: a differentiable gather
of torch.chunk pieces (comm.placement's Shard), the vocab-parallel cross-entropy, and the
sequence-parallel cut after a module that must see the whole sequence (a recipe's sp_split).

Activations sharded along the sequence use meshspeed.comm's tensor_split chunks (gather_sp /
reduce_scatter_sp); parameters and vocab-sharded logits use torch.chunk chunks, which is what
DTensor's Shard(dim) and checkpoints expect. The two agree whenever the extent divides tp.
"""

from __future__ import annotations

import torch

from meshspeed import comm
from meshspeed.comm.placement import Shard, chunk_sizes, local_piece
from meshspeed.comm.recipe import get_optional


def gather_chunks(x: torch.Tensor, group: comm.Group, dim: int, n: int) -> torch.Tensor:
    """All-gather torch.chunk pieces of a length-n dimension (no gradient)."""
    return comm.all_gather(x.contiguous(), group, dim % x.dim(), sizes=chunk_sizes(n, group.size))


class _GatherChunks(torch.autograd.Function):
    """All-gather forward; keep my torch.chunk piece of the (replicated) gradient backward."""

    @staticmethod
    def forward(ctx, x, group, dim, n):
        ctx.group, ctx.dim = group, dim
        return gather_chunks(x, group, dim, n)

    @staticmethod
    def backward(ctx, g):
        return local_piece(g, Shard(ctx.dim), ctx.group.rank, ctx.group.size).contiguous(), None, None, None


def gather_chunks_ad(x: torch.Tensor, group: comm.Group, dim: int, n: int) -> torch.Tensor:
    """Differentiable gather_chunks (comm.gather_from with torch.chunk pieces)."""
    if torch.compiler.is_compiling():
        sizes = chunk_sizes(n, group.size)
        if len(set(sizes)) == 1:  # torch.chunk's pieces are tensor_split's: the traceable gather
            return comm.gather_from(x, group, dim % x.dim(), sizes)
        return torch.compiler.disable(_GatherChunks.apply)(x, group, dim % x.dim(), n)
    return _GatherChunks.apply(x, group, dim % x.dim(), n)


class _VocabParallelCE(torch.autograd.Function):
    """Megatron's vocab-parallel cross-entropy; every rank returns the same mean loss."""

    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start, ignore_index, per_token=False):
        # logits [tokens, V_local], targets [tokens] (global ids)
        x = logits.to(torch.promote_types(logits.dtype, torch.float32))
        width = x.shape[-1]
        # One max all-reduce gives the row maxima and, when not given, the full piece width
        # ceil(V / tp) (rank 0's), from which torch.chunk's start of every piece follows.
        m = torch.cat([x.amax(-1), x.new_tensor([float(width)])])
        comm.all_reduce(m, group, "max")
        if vocab_start is None:
            vocab_start = group.rank * int(m[-1].item())
        x = x - m[:-1, None]  # [tokens, V_local], <= 0
        local = targets - vocab_start
        in_range = ((local >= 0) & (local < width)).to(x.dtype)  # [tokens]
        safe = local.clamp(0, max(width - 1, 0))
        # Out-of-range targets pick an arbitrary local logit that the mask multiplies to zero
        # (a multiply, not a masked assignment, so it is one fused elementwise op everywhere).
        picked = x.gather(-1, safe[:, None]).squeeze(-1) * in_range
        exp = x.exp_()
        stats = torch.stack([exp.sum(-1), picked])  # [2, tokens]: one all-reduce for both
        comm.all_reduce(stats, group)
        sum_exp, picked = stats[0], stats[1]
        valid = (targets != ignore_index).to(x.dtype)
        loss = (sum_exp.log() - picked) * valid  # per token, 0 where ignored
        if per_token:  # reduction="none": d loss_i / d logit = (softmax - onehot) * valid_i
            scale = valid
        else:
            n_valid = valid.sum()  # 0 -> nan, as F.cross_entropy
            loss, scale = loss.sum() / n_valid, valid / n_valid
        softmax = exp.div_(sum_exp[:, None])
        ctx.save_for_backward(softmax, safe, in_range, scale)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, safe, in_range, scale = ctx.saved_tensors
        # d loss / d logit = (softmax - onehot(target)) * valid / n_valid; the one-hot lives
        # only on the rank owning the target (in_range), so no communication is needed.
        grad = softmax.scatter_add(-1, safe[:, None], -in_range[:, None])
        grad = grad * (scale * g)[:, None]  # g: a scalar (mean) or one per token (per_token)
        return grad.to(ctx.in_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    group: comm.Group,
    ignore_index: int = -100,
    vocab_start: int | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of logits sharded along the vocabulary.

    logits [batch, seq, V_local] (this rank's torch.chunk piece of the vocabulary), targets
    [batch, seq] global ids; targets equal to `ignore_index` count neither in the sum nor in
    the mean. `vocab_start`: first id of this rank's piece (default: torch.chunk's, found in
    the max all-reduce). Two all-reduces; the backward needs none. Same value on every rank.
    """
    if logits.shape[-1] == 0:
        raise ValueError(
            "vocab_parallel_cross_entropy: this rank holds no vocabulary "
            "(empty shard); use a tp that leaves every rank some of the vocabulary"
        )
    return _VocabParallelCE.apply(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), group, vocab_start, ignore_index
    )


def vocab_parallel_token_ce(
    logits: torch.Tensor, targets: torch.Tensor, group: comm.Group, ignore_index: int = -100, vocab_start=None
) -> torch.Tensor:
    """Per-token cross-entropy [batch, seq] of vocabulary-sharded logits (0 where the target is
    `ignore_index`): what sequence log-probabilities (DPO) sum. Same value on every rank."""
    if logits.shape[-1] == 0:
        raise ValueError("vocab_parallel_token_ce: this rank holds no vocabulary (empty shard)")
    flat = _VocabParallelCE.apply(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), group, vocab_start, ignore_index, True
    )
    return flat.view(targets.shape)


def split_sequence_after(model: torch.nn.Module, fqn: str, group: comm.Group) -> None:
    """Cut the output of `model.fqn` [batch, seq, ...] to this rank's rows [batch, seq/tp, ...]
    (split_to: the backward all-gathers each rank's gradient rows, so the module, run whole on
    every tp rank, gets the whole gradient). A forward hook: FQNs, attributes and checkpoints
    of the module are unchanged. A pipeline stage without the module skips it."""
    module = get_optional(model, fqn)
    if module is None:
        return

    def cut(module, args, h: torch.Tensor) -> torch.Tensor:
        if h.shape[1] % group.size:
            raise comm.ConfigError(
                f"sequence parallelism needs the sequence length divisible by parallel.tp={group.size}, "
                f"got seq={h.shape[1]} after {fqn}; pad the batch to a multiple of {group.size} or turn "
                "sequence_parallel off"
            )
        return comm.split_to(h, group, 1)

    module.register_forward_hook(cut)
