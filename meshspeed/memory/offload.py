"""Optimizer state on the host (`memory.offload_optimizer`, MindSpeed's swap-optimizer).

AdamW's fp32 master and two moments (12 bytes per parameter in bf16 training, 1/dp of that under
ZeRO-1/2) are only used by the optimizer step, yet sit in device memory through forward and
backward. Here each bucket's state lives in one host buffer [rows, M] (pinned when the device is
CUDA) and comes to the device for its bucket's update only:

    step():  bucket i  open:  wait for its host->device copy; start bucket i+1's
                       update on the device (the same kernels as without offload)
                       close: start its device->host copy; publish the parameters

so the copy of the next bucket in and of the previous one out run behind the current update
(two side streams and events on CUDA; on CPU the copies are plain host-to-host, the same code
path). The device holds about two buckets' state during the step and none outside it. The
update runs on the device exactly as before, so losses are bit-identical; the step count is a
host integer as ever. Reading or loading the state (checkpoints) goes through the same
open/close, so it sees what the last copy wrote.
"""

from __future__ import annotations

import contextlib

import torch


class HostState:
    """The offloaded shards of one optimizer: their host buffers, the copy streams, and the
    device copies in flight."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.to_device = torch.cuda.Stream(device) if self.cuda else None
        self.to_host = torch.cuda.Stream(device) if self.cuda else None
        self.shards: list[HostShard] = []
        self._fetched: dict[int, tuple[torch.Tensor, object]] = {}  # shard -> (device copy, ready event)
        self.stats = {"to_device_bytes": 0, "to_host_bytes": 0, "prefetched": 0}

    def _stream(self, s):
        return torch.cuda.stream(s) if self.cuda else contextlib.nullcontext()

    def fetch(self, j: int) -> None:
        """Start bringing shard j's state to the device (once)."""
        if j in self._fetched:
            return
        sh = self.shards[j]
        with self._stream(self.to_device):
            if self.cuda and sh.stored is not None:
                self.to_device.wait_event(sh.stored)  # its last trip to the host has landed
            dev = torch.empty(sh.host.shape, dtype=sh.host.dtype, device=self.device)
            dev.copy_(sh.host, non_blocking=self.cuda)
            ready = self.to_device.record_event() if self.cuda else None
        self._fetched[j] = (dev, ready)
        self.stats["to_device_bytes"] += sh.host.nbytes

    def take(self, j: int) -> torch.Tensor:
        """Shard j's state on the device, ready for the current stream; the next shard's starts
        coming (a step opens them in order)."""
        self.fetch(j)
        for k in list(self._fetched):  # a prefetch nobody opened: give its memory back
            if k not in (j, j + 1):
                del self._fetched[k]
        if j + 1 < len(self.shards) and j + 1 not in self._fetched:
            self.fetch(j + 1)
            self.stats["prefetched"] += 1
        dev, ready = self._fetched.pop(j)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(ready)
            dev.record_stream(torch.cuda.current_stream(self.device))  # allocated on to_device
        return dev

    def put(self, j: int, dev: torch.Tensor) -> None:
        """Start copying shard j's updated state back to its host buffer."""
        sh = self.shards[j]
        if self.cuda:
            self.to_host.wait_stream(torch.cuda.current_stream(self.device))  # the update is done
        with self._stream(self.to_host):
            sh.host.copy_(dev, non_blocking=self.cuda)
            if self.cuda:
                dev.record_stream(self.to_host)  # not reused before the copy has read it
                sh.stored = self.to_host.record_event()
        self.stats["to_host_bytes"] += sh.host.nbytes

    def host_bytes(self) -> int:
        return sum(sh.host.nbytes for sh in self.shards)


class HostShard:
    """A ZeroAdamW shard (optim._Shard's interface) kept on the host. Rows of `host`: the
    master (when the shard owns one; fp32 parameters at zero=0 are their own master and stay
    on the device), exp_avg, exp_avg_sq. Outside open()/close() the attributes are the host
    rows: read them only, and on CUDA through open() (which waits for the last copy back)."""

    def __init__(self, state: HostState, index: int, st):
        self.state, self.index, self.decay = state, index, st.decay
        self.owns_master = st.owns_master
        self._device_master = None if st.owns_master else st.master
        rows = [st.master, st.exp_avg, st.exp_avg_sq] if st.owns_master else [st.exp_avg, st.exp_avg_sq]
        self.host = torch.empty(
            len(rows), st.exp_avg.numel(), dtype=torch.float32, pin_memory=state.cuda
        )  # [rows, M]
        for r, t in enumerate(rows):
            self.host[r].copy_(t)
        self.stored = None  # CUDA event: the last device->host copy has landed
        self._dev: torch.Tensor | None = None
        self._bind(self.host)

    def _bind(self, rows: torch.Tensor) -> None:
        if self.owns_master:
            self.master, self.exp_avg, self.exp_avg_sq = rows[0], rows[1], rows[2]
        else:
            self.master, self.exp_avg, self.exp_avg_sq = self._device_master, rows[0], rows[1]

    def open(self) -> None:
        if self._dev is None:
            self._dev = self.state.take(self.index)
            self._bind(self._dev)

    def close(self, changed: bool = True) -> None:
        if self._dev is None:
            return
        if changed:
            self.state.put(self.index, self._dev)
        self._dev = None
        self._bind(self.host)

    def nbytes(self) -> int:
        return 0  # nothing stays on the device


@torch.no_grad()
def offload_optimizer(opt) -> HostState:
    """Move a freshly built ZeroAdamW's state to the host (its shards replaced by HostShards).
    Returns the HostState (copy statistics, host bytes)."""
    device = opt.dp.buckets[0].data.device
    state = HostState(device)
    for i, st in enumerate(opt.shards):
        sh = HostShard(state, i, st)
        state.shards.append(sh)
        opt.shards[i] = sh
    opt.offload = state
    return state
