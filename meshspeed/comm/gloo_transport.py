"""One gloo transport device per process, shared by every gloo group meshspeed makes.

torch gives each gloo process group a transport device of its own, and each device runs a
thread that wakes about every 10 ms to poll its sockets, work or not. A rank holds one group
per mesh dim, per expert and node split, per flattened DTensor dim: measured on torch 2.13,
a rank holding 31 idle groups burned 13% of a core in those threads, 4 ranks half a core, on
a machine whose cores all run ranks. gloo itself lets any number of groups share a device (a
group's connections are told apart by their own addresses and sequence numbers); torch only
never asks. While `shared()` is active, a gloo group torch makes gets this process's device:
one polling thread however many groups there are. NCCL groups are untouched.

torch builds gloo groups by calling the name `ProcessGroupGloo` in `distributed_c10d` (its
gloo options, passed through `new_group`, are ignored); `shared()` puts a subclass under that
name while meshspeed makes groups and puts the original back after, so an isinstance check by
torch outside those calls sees the class it expects.
"""

from __future__ import annotations

import contextlib
import os
import threading

from torch.distributed import distributed_c10d as c10d

_lock = threading.RLock()
_classes: dict[type, type] = {}
_devices: dict[int, list] = {}  # pid -> devices: a forked child must make its own (the thread is not copied)


def devices() -> list:
    """This process's gloo transport devices, made on first use as torch makes a group's own:
    one per interface in GLOO_SOCKET_IFNAME, else one on the host name's address."""
    pid = os.getpid()
    if pid not in _devices:
        _devices.clear()
        names = [n for n in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
        make = c10d.ProcessGroupGloo
        _devices[pid] = [make.create_device(interface=n) for n in names] or [make.create_default_device()]
    return _devices[pid]


def _shared_class(base):
    class SharedDeviceGloo(base):
        """A gloo group on the process's shared device; otherwise torch's own."""

        def __init__(self, store, rank, size, options=None, timeout=None):
            # torch calls (store, rank, size, timeout=...); an options object is taken as given
            if not isinstance(options, base._Options):
                timeout = options if timeout is None else timeout
                options = base._Options()
                if timeout is not None:
                    options._timeout = timeout
            if not options._devices:
                options._devices = devices()
                options._threads = 2 * len(options._devices)  # torch's own count per group
            super().__init__(store, rank, size, options)

    return SharedDeviceGloo


@contextlib.contextmanager
def shared(backend: str = "gloo"):
    """Gloo groups made inside share this process's transport device (no-op for other backends,
    or where this torch has no gloo)."""
    base = getattr(c10d, "ProcessGroupGloo", None)
    if backend != "gloo" or base is None or not hasattr(base, "_Options"):
        yield
        return
    with _lock:
        if getattr(base, "_meshspeed_shared", False):  # nested: already swapped
            yield
            return
        if base not in _classes:
            _classes[base] = _shared_class(base)
            _classes[base]._meshspeed_shared = True
        c10d.ProcessGroupGloo = _classes[base]
        try:
            yield
        finally:
            c10d.ProcessGroupGloo = base
