"""Key/value cache for the Llama-family attention, installed from outside the model.

`Attention.core` is swappable data (context parallelism replaces it too): the cache swaps in a
core per layer that appends the new keys/values to that layer's cache and attends over all of
them, so models/llama.py needs no cache argument and tensor-parallel shards (fewer local heads)
and pipeline stages (fewer layers) run through the same code.

Batches of prompts of different lengths are left padded: every sequence ends at the same slot,
so one decode step appends one slot to all of them. `valid` marks the real (non-pad) slots;
RoPE positions count real tokens only, so a padded prompt sees the same positions (and hence
the same logits) as the prompt alone.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from meshspeed.models.llama import Attention, repeat_kv


def left_pad(prompts: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> tokens [batch, max_len] left padded with pad_id, valid [batch, max_len] bool."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts: every prompt needs at least one token; drop empty prompts")
    width = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool)
    for i, p in enumerate(prompts):
        tokens[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        valid[i, width - len(p) :] = True
    return tokens, valid


class KVCache:
    """Keys and values of every attention layer of one model (or pipeline stage) for one batch.

    Per layer: k, v [batch, slots, local_kv_heads, head_dim], grown by concatenation (CPU
    inference at test sizes; a preallocated ring is the obvious next step for long outputs).
    """

    def __init__(self, valid: torch.Tensor):
        self.valid = valid  # [batch, slots] bool: real tokens so far, pads False
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    @property
    def slots(self) -> int:
        return self.valid.shape[1]

    def positions(self, new: int) -> torch.Tensor:
        """RoPE positions [batch, new] of the last `new` slots: real tokens counted from 0."""
        pos = self.valid.long().cumsum(1) - 1
        return pos[:, -new:].clamp(min=0)

    def append(self, valid_new: torch.Tensor) -> None:
        """Mark `valid_new` [batch, new] slots as the next ones (call before the forward)."""
        self.valid = torch.cat([self.valid, valid_new.to(self.valid.device)], dim=1)

    def mask(self, new: int) -> torch.Tensor:
        """[batch, 1, new, slots] bool: a query sees real keys at or before its own slot, and
        always itself, so a pad query's row is never empty (SDPA would return NaN)."""
        slots = self.slots
        q_slot = torch.arange(slots - new, slots, device=self.valid.device)[:, None]  # [new, 1]
        k_slot = torch.arange(slots, device=self.valid.device)[None, :]  # [1, slots]
        causal = k_slot <= q_slot
        return ((causal & self.valid[:, None, :]) | (k_slot == q_slot))[:, None]

    def core(self, layer: int):
        """The attention core of `layer`: q [batch, new, heads, hd], k/v [batch, new, kv, hd]
        (RoPE applied) -> [batch, new, heads, hd] over the cached and the new keys."""

        def cached_core(q, k, v, doc_ids=None):
            if doc_ids is not None:
                raise ValueError("KVCache: packed documents (doc_ids) are a training input, not inference")
            if layer in self.k:
                k = torch.cat([self.k[layer], k], dim=1)
                v = torch.cat([self.v[layer], v], dim=1)
            self.k[layer], self.v[layer] = k, v
            n_rep = q.shape[2] // k.shape[2]
            k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
            out = F.scaled_dot_product_attention(  # [batch, heads, new, head_dim]
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=self.mask(q.shape[1])
            )
            return out.transpose(1, 2)

        return cached_core


def attention_modules(model: nn.Module) -> dict[int, Attention]:
    """Layer index -> attention module of the layers this model (or stage) holds."""
    found = {}
    for name, mod in model.named_modules():
        if isinstance(mod, Attention):
            found[int(name.split(".")[1])] = mod  # "layers.<i>.attention"
    return found


@contextmanager
def installed(model: nn.Module, cache: KVCache):
    """Swap the cache's cores into `model` for the duration; the previous cores come back."""
    mods = attention_modules(model)
    saved = {i: m.core for i, m in mods.items()}
    try:
        for i, m in mods.items():
            m.core = cache.core(i)
        yield cache
    finally:
        for i, m in mods.items():
            m.core = saved[i]
