"""Output projection + cross-entropy in chunks: the full logits never exist.

Two ways, the same value (up to float summation order):
- fused (impl "torch" or "triton", the default where the head allows it): Liger's fused linear
  cross-entropy (kernels.linear_ce): each chunk's logits are scored and differentiated in the
  forward pass, so nothing is recomputed; what waits for backward is d hidden and d weight
  (the weight's gradient, which it gets anyway) instead of [tokens, vocab / tp] logits. It
  applies to a bias-free head scored by the plain cross-entropy: an nn.Linear, or the
  vocab-parallel ColumnParallelLinear (its input collective runs first, the vocab-parallel
  statistics are reduced per chunk);
- checkpoint (impl "checkpoint", and any other head or loss): each chunk is projected and
  scored under a checkpoint, so forward keeps only the chunk's input and its scalar loss, and
  backward recomputes one chunk's logits at a time (one more projection matmul). `loss_fn` is
  the model's own (plain or vocab-parallel) mean cross-entropy, run unchanged on each chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from meshspeed import comm
from meshspeed.comm.placement import chunk_bounds
from meshspeed.kernels.linear_ce import linear_cross_entropy
from meshspeed.kernels.loss import cross_entropy_loss

from .count import note_kept


def _chunk_sum(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    output: nn.Module,
    loss_fn: Callable,
    ignore_index: int,
    n: int,
) -> torch.Tensor:
    # mean over the chunk's n counted tokens × n: the chunk's summed loss
    return loss_fn(output(hidden), targets, ignore_index) * n


def chunked_loss(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    output: nn.Module,
    loss_fn: Callable,
    chunk: int,
    ignore_index: int = -100,
    sp_ranks: int = 1,
    impl: str = "torch",
) -> torch.Tensor:
    """Mean cross-entropy of `output(hidden)` against targets, `chunk` positions at a time
    (fused: chunks of batch × chunk × sp_ranks rows; chunk 0: kernels.linear_ce's size).

    hidden [batch, seq, dim], targets [batch, seq]; loss_fn(logits, targets, ignore_index) ->
    mean over counted tokens. Equal to loss_fn(output(hidden), targets) up to float summation
    order. Under sequence parallelism (`sp_ranks` = tp > 1) hidden is this rank's block
    [batch, seq/tp, dim]; fused, the head's all-gather brings the whole sequence first;
    checkpointed, `output` gathers chunk by chunk: chunk j of every rank's block makes one
    gathered chunk, rank-major, so its targets are column j of targets viewed
    [batch, tp, seq/tp] (every rank cuts the same chunks, so the gathers match).
    """
    if chunk < 0 or (chunk == 0 and impl == "checkpoint"):
        raise ValueError(f"memory.chunked_loss chunk={chunk}; use a positive number of positions")
    if impl != "checkpoint" and (fused := fused_head(output, loss_fn)) is not None:
        x, weight, group, start = fused(hidden)
        rows = chunk * hidden.shape[0] * sp_ranks
        return linear_cross_entropy(
            x, weight, targets, ignore_index, chunk=rows, group=group, vocab_start=start, impl=impl
        )
    chunk = chunk or 256
    blocks = targets.reshape(targets.shape[0], sp_ranks, -1)  # [batch, tp, seq/tp]
    starts = range(0, blocks.shape[2], chunk)

    def chunk_targets(i: int) -> torch.Tensor:
        return blocks[:, :, i : i + chunk].reshape(targets.shape[0], -1)

    counts = [(chunk_targets(i) != ignore_index).sum().item() for i in starts]
    total = sum(counts)
    parts = []
    for j, i in enumerate(starts):
        if counts[j] == 0:  # every position ignored: no term (its mean would be 0 / 0)
            continue
        h = hidden[:, i : i + chunk]
        note_kept((h,))
        parts.append(
            checkpoint(
                _chunk_sum,
                h,
                chunk_targets(i),
                output,
                loss_fn,
                ignore_index,
                counts[j],
                use_reentrant=False,
            )
        )
    if not parts:  # nothing counted: the plain loss's value (NaN), still connected to the graph
        return loss_fn(output(hidden[:, :1]), blocks[:, :, :1].reshape(targets.shape[0], -1), ignore_index)
    return torch.stack(parts).sum() / total


def fused_head(output: nn.Module, loss_fn: Callable):
    """For a head the fused loss computes exactly, `enter(hidden) -> (x, weight, group,
    vocab_start)`: x is what the head's matmul takes (gathered / entered into the tensor-parallel
    region, with its autograd); None for any other head or loss."""
    if getattr(output, "bias", None) is not None:
        return None
    if isinstance(output, nn.Linear) and loss_fn is cross_entropy_loss:
        return lambda h: (h, output.weight, None, 0)
    # the vocab-parallel ColumnParallelLinear (duck-typed) scored by its vocab-parallel loss
    if (
        getattr(output, "vocab_parallel", False)
        and not output.gather_output
        and getattr(loss_fn, "vocab_parallel", False)
    ):
        group = output.group
        start = chunk_bounds(output.full_out_features, group.size)[group.rank]

        def enter(h):
            x = comm.gather_sp(h, group, 1) if output.sequence_parallel else comm.copy_to(h, group)
            return x, output.weight, group, start

        return enter
    return None


def chunked_model_loss(
    model: nn.Module,
    forward: Callable[[], torch.Tensor],
    targets: torch.Tensor,
    loss_fn: Callable,
    chunk: int,
    sp_ranks: int = 1,
    head: str = "output",
    impl: str = "torch",
) -> torch.Tensor:
    """`forward()` runs `model` (or the last pipeline stage of it) with its output projection
    swapped out, then the loss is taken chunk by chunk (chunked_loss)."""
    with hidden_states_out(model, head) as out:
        hidden = forward()
    return chunked_loss(hidden, targets, out, loss_fn, chunk, sp_ranks=sp_ranks, impl=impl)


@contextmanager
def hidden_states_out(model: nn.Module, head: str = "output"):
    """Inside, `model`'s forward returns the hidden states that feed `head` (its output
    projection): the head is swapped for an identity and put back on exit. Its parameters never
    leave the model for longer than the forward, so names, the optimizer's buckets and
    checkpoints are untouched. Yields the head, for chunked_loss."""
    out = getattr(model, head)
    setattr(model, head, nn.Identity())
    try:
        yield out
    finally:
        setattr(model, head, out)
