"""Activations swapped to host memory (`memory.swap_activations`, MindSpeed's swap-attention).

Each block's attention core (`Attention.core`) runs under saved-tensor hooks. What it saves for
backward, its inputs q, k, v (k and v repeated to every head) and the softmax log-sum-exp, is
copied to (pinned) host memory when the core returns and only the host copy is kept; the device
copies go with the forward's own references. Its output is saved too but stays: it is the
output projection's saved input, alive on the device anyway. Per block that moves
3·T·H·hd·e + 4·T·H bytes (T tokens, H local heads, element size e) off the device; with one kv
head on the rank, k and v are broadcast views of it and stay (T·H·hd·e + 4·T·H move).

In backward, the first time a core's tensors are needed they are copied back (unless already
there), and the copy of the core that backward reaches next (the one packed before it in the
same forward pass) is started, so it runs behind this core's backward: about two cores' tensors
are on the device at a time. On CUDA the copies use two side streams and events; on CPU they are
host-to-host copies down the same path. Values and strides are kept, so losses and gradients are
bit-identical to the run without.

Not with recompute selective or full: those recompute the core instead of keeping anything.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn


def _dense(t: torch.Tensor) -> bool:
    """The strides describe a permutation of a contiguous layout (no gaps, no overlap)."""
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
    expected = 1
    for s, n in dims:
        if s != expected:
            return False
        expected *= n
    return True


def _on(t: torch.Tensor, device: torch.device) -> bool:
    """t is on `device` ("cuda" without an index: any GPU, the current one in practice)."""
    return t.device.type == device.type and device.index in (None, t.device.index)


class _Group:
    """What one call of a swapped function saved: host copies, later device copies."""

    def __init__(self, swap: ActivationSwap, prev: weakref.ref | None):
        self.swap, self.prev = swap, prev  # prev: the group packed just before, same forward
        self.host: list[torch.Tensor | tuple] = []
        self.device: list[torch.Tensor] | None = None
        self.stored = None  # CUDA event: the device->host copies have landed
        self.ready = None  # CUDA event: the host->device copies have landed

    def pack(self, t: torch.Tensor) -> int:
        self.host.append(t)  # moved when the call returns (offload)
        return len(self.host) - 1

    def offload(self, outputs: set[int]) -> None:
        """After the call: move what it saved to the host, except what is not on the training
        device and what shares a storage with the call's outputs (the next layer keeps that
        alive anyway: the attention output is the output projection's saved input)."""
        s = self.swap
        for i, t in enumerate(self.host):
            st = t.untyped_storage()
            # a broadcast view (k, v repeated from one kv head) stays: its storage is one head's,
            # and a host copy would write out every repeat and bring them all back in backward
            if not _on(t, s.device) or st._cdata in outputs or st.nbytes() < t.numel() * t.element_size():
                self.host[i] = ("kept", t)
                continue
            if _dense(t):
                host = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, pin_memory=s.cuda)
            else:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=s.cuda)
            if s.cuda:
                s.to_host.wait_stream(torch.cuda.current_stream(s.device))  # t has been computed
                with torch.cuda.stream(s.to_host):
                    host.copy_(t, non_blocking=True)
                    t.record_stream(s.to_host)  # its memory is not reused before the copy read it
            else:
                host.copy_(t)
            s.stats["swapped_bytes"] += host.untyped_storage().nbytes()
            s.stats["swapped_tensors"] += 1
            self.host[i] = host
        if s.cuda:
            self.stored = s.to_host.record_event()

    def fetch(self) -> None:
        """Start the copies back to the device (once)."""
        if self.device is not None:
            return
        s = self.swap
        ctx = torch.cuda.stream(s.to_device) if s.cuda else contextlib.nullcontext()
        with ctx:
            if s.cuda and self.stored is not None:
                s.to_device.wait_event(self.stored)
            self.device = [
                h[1] if isinstance(h, tuple) else h.to(s.device, non_blocking=s.cuda, copy=True)
                for h in self.host
            ]
            self.ready = s.to_device.record_event() if s.cuda else None
        self.host = []  # the pinned blocks return to torch's host cache once the copies are done

    def unpack(self, i: int) -> torch.Tensor:
        s = self.swap
        if self.device is None:
            s.stats["fetched_on_demand"] += 1
        self.fetch()
        if s.cuda:
            cur = torch.cuda.current_stream(s.device)
            cur.wait_event(self.ready)
            if _on(self.device[i], s.device):
                self.device[i].record_stream(cur)  # allocated on to_device, used here
        prev = self.prev() if self.prev is not None else None
        if prev is not None and prev.device is None:
            prev.fetch()  # the core backward reaches next: its copy runs behind this one
            s.stats["prefetched"] += 1
        return self.device[i]


class ActivationSwap:
    """Saved tensors of the functions it wraps go to host memory in forward and come back in
    backward, one call ahead."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.to_host = torch.cuda.Stream(self.device) if self.cuda else None
        self.to_device = torch.cuda.Stream(self.device) if self.cuda else None
        self._last: weakref.ref | None = None
        self.stats = {"swapped_bytes": 0, "swapped_tensors": 0, "prefetched": 0, "fetched_on_demand": 0}

    def wrap(self, fn):
        def run(*args, **kwargs):
            if not torch.is_grad_enabled():
                return fn(*args, **kwargs)
            group = _Group(self, self._last)
            self._last = weakref.ref(group)
            # autograd holds (group, index) for each saved tensor until its backward has run
            with torch.autograd.graph.saved_tensors_hooks(lambda t: (group, group.pack(t)), _unpack):
                out = fn(*args, **kwargs)
            group.offload(_storages(out))
            return out

        run.swapped = fn  # the wrapped function, for inspection / undo
        run.swap = self
        return run


def _storages(out) -> set[int]:
    if isinstance(out, torch.Tensor):
        return {out.untyped_storage()._cdata}
    if isinstance(out, (tuple, list)):
        return set().union(*(_storages(o) for o in out)) if out else set()
    return set()


def _unpack(packed) -> torch.Tensor:
    group, i = packed
    return group.unpack(i)


def apply_swap_activations(
    model: nn.Module, device, layers: int | None = None, layers_attr: str = "layers"
) -> ActivationSwap:
    """Swap the attention cores' saved tensors of the first `layers` blocks (None: all) of
    `model`'s `layers_attr` container to host memory, in place. Returns the ActivationSwap
    (its stats count what moved)."""
    if layers is not None and layers < 0:
        raise ValueError(f"memory.swap_layers={layers} is negative; use 0 or more (or leave it unset: all)")
    container = getattr(model, layers_attr, None)
    blocks = (
        []
        if container is None
        else list(container.values() if isinstance(container, nn.ModuleDict) else container)
    )
    swap = ActivationSwap(device)
    for block in blocks[:layers]:
        for m in block.modules():
            if callable(getattr(m, "core", None)):
                m.core = swap.wrap(m.core)
    return swap


def attention_swap_bytes(
    *, tokens: int, n_heads: int, head_dim: int, tp: int = 1, elem: int = 4, n_kv_heads: int | None = None
) -> int:
    """Device bytes swapping one block's attention core moves to the host, per micro-batch:
    q and the repeated k and v ([T, H, hd] each, H = n_heads / tp) and the float32 log-sum-exp.
    With one kv head on the rank (n_kv_heads ≤ tp) k and v are broadcast views of it and stay."""
    heads = n_heads // tp
    kv = heads if n_kv_heads is None else max(1, n_kv_heads // tp)
    qkv = (3 if kv > 1 or heads == 1 else 1) * tokens * heads * head_dim * elem
    return qkv + 4 * tokens * heads
