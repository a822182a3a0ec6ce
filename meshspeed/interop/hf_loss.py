"""`parallelize(..., chunked_loss=True)`: a `transformers` causal LM's `labels=` loss without the
full logits.

Hugging Face's forward projects every position to the vocabulary ([batch, seq, vocab] logits,
4 bytes each in float32, kept for backward) and then takes the cross-entropy. With chunked_loss
the model's forward, when given labels, runs the decoder (`model.model`), then scores the final
hidden states against the shifted labels through kernels.linear_ce: the head's matmul and the
loss a chunk of rows at a time, each chunk's gradient formed in the forward pass (Liger's fused
linear cross-entropy), so no [tokens, vocab] tensor outlives its chunk. Under tensor parallelism
the head's weight is this rank's slice of the vocabulary and the softmax statistics are reduced
over tp per chunk; under sequence parallelism the hidden states are gathered first, as the head
itself would gather them. The value is Hugging Face's loss (mean over the labels that are not
-100, or the sum over `num_items_in_batch`) up to float summation order; `.logits` is None then,
as with Liger's fused loss. Without labels the forward is Hugging Face's own.

The wrapper is the model's `forward`, called through the model's `__call__`: ZeRO-3's root unit
(embedding, final norm, head) is gathered by its pre-hook as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from meshspeed import comm
from meshspeed.comm.placement import chunk_bounds
from meshspeed.kernels.linear_ce import linear_cross_entropy

IGNORE = -100  # Hugging Face's ignore_index

__all__ = ["chunk_loss_forward"]


def _head_input(model: nn.Module, hidden: torch.Tensor):
    """(rows for the head's matmul, its weight, the vocab-parallel group or None, vocab_start)."""
    head = model.lm_head
    group = getattr(head, "group", None)
    if group is None or group.size == 1:
        return hidden, head.weight, None, 0
    x = comm.gather_sp(hidden, group, 1) if head.sequence_parallel else comm.copy_to(hidden, group)
    return x, head.weight, group, chunk_bounds(head.full_out_features, group.size)[group.rank]


def chunk_loss_forward(model: nn.Module, chunk: int = 0):
    """Set `model.forward` to the chunked-loss forward (module docstring); `chunk`: rows per
    chunk (0: kernels.linear_ce's default)."""
    own = model.forward

    def forward(input_ids=None, labels=None, **kwargs):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        if labels is None:
            return own(input_ids=input_ids, **kwargs)
        n_items = kwargs.pop("num_items_in_batch", None)
        kwargs.pop("logits_to_keep", None)
        out = model.model(input_ids=input_ids, **kwargs)
        x, weight, group, start = _head_input(model, out.last_hidden_state)
        targets = F.pad(labels, (0, 1), value=IGNORE)[..., 1:].to(x.device)  # Hugging Face's shift
        loss = linear_cross_entropy(
            x.flatten(0, -2), weight, targets.flatten(), IGNORE, chunk=chunk, group=group, vocab_start=start
        )
        if n_items is not None:  # a sum over the batch's items, as Hugging Face's loss takes it
            loss = loss * (targets != IGNORE).sum() / n_items
        # no cache: a forward given labels trains (or evaluates) the whole sequence
        return CausalLMOutputWithPast(
            loss=loss, logits=None, hidden_states=out.hidden_states, attentions=out.attentions
        )

    forward.chunked_from = own  # the model's own forward, for inspection
    model.forward = forward
