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

from meshspeed.models.llama import Attention


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

    Per layer: k, v [batch, kv_heads, capacity, head_dim], allocated once on the device of the
    first keys written (heads first: each head's keys are one contiguous run for the attention
    kernel); a step writes its slots in place, so a decode step moves its own keys only, not
    the whole cache as concatenation did. `capacity`: the most slots the batch will hold
    (prompt width + new tokens); a cache made without it doubles when full.
    """

    def __init__(self, valid: torch.Tensor, capacity: int | None = None):
        """`valid` [batch, slots] bool: the slots so far (usually none: valid[:, :0]); the cache's
        masks and positions live on its device, which should be the model's."""
        self.length = valid.shape[1]
        self._valid = torch.zeros(valid.shape[0], max(capacity or 0, self.length, 1), dtype=torch.bool,
                                  device=valid.device)  # fmt: skip
        self._valid[:, : self.length] = valid
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    @property
    def capacity(self) -> int:
        return self._valid.shape[1]

    @property
    def valid(self) -> torch.Tensor:
        """[batch, slots] bool: real tokens so far, pads False."""
        return self._valid[:, : self.length]

    @property
    def slots(self) -> int:
        return self.length

    def positions(self, new: int) -> torch.Tensor:
        """RoPE positions [batch, new] of the last `new` slots: real tokens counted from 0."""
        pos = self.valid.long().cumsum(1) - 1
        return pos[:, -new:].clamp(min=0)

    def append(self, valid_new: torch.Tensor) -> None:
        """Mark `valid_new` [batch, new] slots as the next ones (call before the forward)."""
        end = self.length + valid_new.shape[1]
        if end > self.capacity:
            self._grow(max(end, 2 * self.capacity))
        self._valid[:, self.length : end] = valid_new.to(self._valid.device)
        self.length = end

    def _grow(self, capacity: int) -> None:
        old = self._valid
        self._valid = old.new_zeros(old.shape[0], capacity)
        self._valid[:, : old.shape[1]] = old
        for store in (self.k, self.v):
            for layer, t in store.items():
                store[layer] = t.new_zeros(*t.shape[:2], capacity, t.shape[3])
                store[layer][:, :, : t.shape[2]] = t

    def mask(self, new: int) -> torch.Tensor:
        """[batch, 1, new, slots] bool: a query sees real keys at or before its own slot, and
        always itself, so a pad query's row is never empty (SDPA would return NaN)."""
        slots = self.slots
        q_slot = torch.arange(slots - new, slots, device=self._valid.device)[:, None]  # [new, 1]
        k_slot = torch.arange(slots, device=self._valid.device)[None, :]  # [1, slots]
        causal = k_slot <= q_slot
        return ((causal & self.valid[:, None, :]) | (k_slot == q_slot))[:, None]

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Put k, v [batch, new, kv, hd] into the last `new` slots; the layer's keys and values
        so far, [batch, kv, slots, hd] views of the cache."""
        if layer not in self.k:
            b, _, kv, hd = k.shape
            self.k[layer] = k.new_zeros(b, kv, self.capacity, hd)
            self.v[layer] = v.new_zeros(b, kv, self.capacity, hd)
        start = self.length - k.shape[1]
        self.k[layer][:, :, start : self.length] = k.transpose(1, 2)
        self.v[layer][:, :, start : self.length] = v.transpose(1, 2)
        return self.k[layer][:, :, : self.length], self.v[layer][:, :, : self.length]

    def core(self, layer: int):
        """The attention core of `layer`: q [batch, new, heads, hd], k/v [batch, new, kv, hd]
        (RoPE applied) -> [batch, new, heads, hd] over the cached and the new keys."""

        def cached_core(q, k, v, doc_ids=None):
            if doc_ids is not None:
                raise ValueError("KVCache: packed documents (doc_ids) are a training input, not inference")
            keys, values = self._write(layer, k, v)  # [batch, kv, slots, hd]
            b, new, heads, hd = q.shape
            kv = keys.shape[1]
            rep = heads // kv
            # Grouped-query heads folded into the query rows, [batch, kv, rep * new, hd], so the
            # cache is read as it is stored: repeating it per query head would copy all of it
            # every step. Query head h = g * rep + r uses kv head g (models/llama.repeat_kv).
            qf = q.reshape(b, new, kv, rep, hd).permute(0, 2, 3, 1, 4).reshape(b, kv, rep * new, hd)
            mask = self.mask(new).repeat(1, 1, rep, 1)  # [batch, 1, rep * new, slots]
            out = F.scaled_dot_product_attention(qf, keys, values, attn_mask=mask)
            return out.reshape(b, kv, rep, new, hd).permute(0, 3, 1, 2, 4).reshape(b, new, heads, hd)

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
