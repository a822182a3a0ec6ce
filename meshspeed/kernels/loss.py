"""Losses shared by every model family and by the parallel layers' plain (unsharded) path."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean next-token loss. logits [batch, seq, vocab], targets [batch, seq].

    Upcast to float32: a bf16 log-softmax over a 128k vocabulary loses visible precision.
    """
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=ignore_index)
