"""Counting the activation bytes autograd keeps between forward and backward.

`count_saved(model)` installs saved-tensor hooks for one forward and reports the bytes held by
the distinct storages saved for backward, measured when the forward has finished (so a storage
freed after use, as the activation recompute frees the SwiGLU product, counts what it still
holds: nothing). Parameters and buffers are not activations and are left out. Checkpointed
regions save through their own hooks and are invisible here; what a checkpoint keeps instead
(its inputs) is reported by `note_kept`, called by meshspeed.memory.recompute.

`cpu_peak_bytes(fn)`: the most bytes fn() holds at once above what was live when it started, on
the CPU (no allocator statistics there), from torch.profiler's memory events.
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


def cpu_peak_bytes(fn) -> int:
    """The most bytes fn() allocates and holds at once, above what was live at its start, from
    torch.profiler's memory events. An event's allocations count from its start and its frees
    from its end: autograd frees a node's inputs and saved tensors when the node's evaluation
    ends, after the operators it ran allocated their outputs (ordering both by start would see
    the free first and miss the peak, by one whole gradient for a loss's backward)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    deltas = []
    for e in prof.events():
        d = e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        if d:
            deltas.append((e.time_range.start if d > 0 else e.time_range.end, d))
    live = peak = 0
    for _, d in sorted(deltas):
        live += d
        peak = max(peak, live)
    return peak
