"""Output projection + cross-entropy in sequence chunks: the full logits never exist.

Each chunk of hidden states is projected and scored under a checkpoint, so forward keeps only
the chunk's input and its scalar loss, and backward recomputes one chunk's logits at a time
([batch, chunk, vocab / tp] instead of [batch, seq, vocab / tp]); Liger's fused linear
cross-entropy is the reference. `loss_fn` is the model's own (plain or vocab-parallel) mean
cross-entropy, so the tensor-parallel projection and loss run unchanged on each chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

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
) -> torch.Tensor:
    """Mean cross-entropy of `output(hidden)` against targets, `chunk` positions at a time.

    hidden [batch, seq, dim] (the full sequence: under sequence parallelism gather it first),
    targets [batch, seq]; loss_fn(logits, targets, ignore_index) -> mean over counted tokens.
    Equal to loss_fn(output(hidden), targets) up to float summation order.
    """
    if chunk < 1:
        raise ValueError(f"memory.chunked_loss chunk={chunk}; use a positive number of positions")
    counts = [
        (targets[:, i : i + chunk] != ignore_index).sum().item() for i in range(0, targets.shape[1], chunk)
    ]
    total = sum(counts)
    parts = []
    for j, i in enumerate(range(0, targets.shape[1], chunk)):
        if counts[j] == 0:  # every position ignored: no term (its mean would be 0 / 0)
            continue
        h = hidden[:, i : i + chunk]
        note_kept((h,))
        parts.append(
            checkpoint(
                _chunk_sum,
                h,
                targets[:, i : i + chunk],
                output,
                loss_fn,
                ignore_index,
                counts[j],
                use_reentrant=False,
            )
        )
    if not parts:  # nothing counted: the plain loss's value (NaN), still connected to the graph
        return loss_fn(output(hidden[:, :1]), targets[:, :1], ignore_index)
    return torch.stack(parts).sum() / total


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
