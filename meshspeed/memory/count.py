"""Counting the activation bytes autograd keeps between forward and backward.

`count_saved(model)` installs saved-tensor hooks for one forward and reports the bytes held by
the distinct storages saved for backward, measured when the forward has finished (so a storage
freed after use, as the activation recompute frees the SwiGLU product, counts what it still
holds: nothing). Parameters and buffers are not activations and are left out. Checkpointed
regions save through their own hooks and are invisible here; what a checkpoint keeps instead
(its inputs) is reported by `note_kept`, called by meshspeed.memory.recompute.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import nn

_ACTIVE: list[SavedBytes] = []  # counters open in this process (innermost last)


class SavedBytes:
    """Distinct storages saved for backward during the counted forward."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        # keyed by the storage object itself (its C++ address), not by its data pointer: a storage
        # freed by resize_(0) gives its address back to the allocator for the next tensor
        self._skip = {t.untyped_storage()._cdata for t in exclude}
        self._storages: dict[int, torch.UntypedStorage] = {}

    def add(self, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            return
        st = t.untyped_storage()
        if st._cdata not in self._skip:
            self._storages.setdefault(st._cdata, st)  # kept alive: the key cannot be reused

    @property
    def bytes(self) -> int:
        """Bytes the saved storages hold now (after the forward: what waits for backward)."""
        return sum(st.nbytes() for st in self._storages.values())


def note_kept(tensors: Iterable) -> None:
    """Count tensors a checkpoint keeps alive outside autograd's saved tensors (its inputs)."""
    for counter in _ACTIVE:
        for t in tensors:
            counter.add(t)


@contextlib.contextmanager
def count_saved(model: nn.Module | None = None) -> Iterator[SavedBytes]:
    """`with count_saved(model) as c: loss = ...forward...` then `c.bytes`."""
    exclude = [] if model is None else [*model.parameters(), *model.buffers()]
    counter = SavedBytes(exclude)

    def pack(t: torch.Tensor) -> torch.Tensor:
        counter.add(t)
        return t

    _ACTIVE.append(counter)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield counter
    finally:
        _ACTIVE.remove(counter)
