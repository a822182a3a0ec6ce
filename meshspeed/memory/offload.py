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

Overlap with backward (`EarlyUpdates`, on by default). With the state on the host the step is
copies plus updates, and they need not wait for the step: a bucket is final once its gradient
reduction has landed in the last micro-batch's backward, and from then on its copy in, update
and copy out run while backward goes on with earlier layers. Until the step decides, the step
may still be skipped (a non-finite loss or norm) or its gradients clipped, so such an early
update is provisional: its new state goes to a second host buffer (the old one is kept) and its
parameters are written as the step would write them; step() then keeps it (the buffers swap, the
ZeRO gather goes out as usual) when it was made with this step's very hyper-parameters and
unscaled gradients, and otherwise puts the parameters back from the old masters and updates as
before. Either way the result is the plain order's bit for bit. Early updates are only tried
after a step that was neither clipped nor skipped (a run that clips every step never pays for
undoing them), and only where the master is offloaded with the moments (bf16 parameters: an fp32
parameter is its own master, which an update cannot take back).
"""

from __future__ import annotations

import contextlib
import dataclasses

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

    def put(self, j: int, dev: torch.Tensor, into: torch.Tensor | None = None) -> None:
        """Start copying shard j's updated state back to its host buffer (or `into`)."""
        sh = self.shards[j]
        if self.cuda:
            self.to_host.wait_stream(torch.cuda.current_stream(self.device))  # the update is done
        with self._stream(self.to_host):
            (sh.host if into is None else into).copy_(dev, non_blocking=self.cuda)
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
        self.writes_params = False
        self._device_master = None if st.owns_master else st.master
        rows = [st.master, st.exp_avg, st.exp_avg_sq] if st.owns_master else [st.exp_avg, st.exp_avg_sq]
        self.host = torch.empty(
            len(rows), st.exp_avg.numel(), dtype=torch.float32, pin_memory=state.cuda
        )  # [rows, M]
        for r, t in enumerate(rows):
            self.host[r].copy_(t)
        self.stored = None  # CUDA event: the last device->host copy has landed
        self.spare: torch.Tensor | None = None  # EarlyUpdates' second buffer: a provisional state
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

    def close(self, changed: bool = True, provisional: bool = False) -> None:
        """provisional: the updated state goes to the spare buffer, `host` keeps the old one
        (until keep() swaps them)."""
        if self._dev is None:
            return
        if changed:
            if provisional and self.spare is None:
                self.spare = torch.empty_like(self.host, pin_memory=self.state.cuda)
            self.state.put(self.index, self._dev, into=self.spare if provisional else None)
        self._dev = None
        self._bind(self.host)

    def keep(self) -> None:
        """The provisional state becomes the state (a swap, no copy)."""
        self.host, self.spare = self.spare, self.host
        self._bind(self.host)

    def nbytes(self) -> int:
        return 0  # nothing stays on the device


class EarlyUpdates:
    """Bucket updates made during the last micro-batch's backward, kept or undone by step()
    (see the module docstring). Installed as opt.early; fed by DataParallel.on_final."""

    def __init__(self, opt):
        self.opt = opt
        self.done = 0  # buckets 0 .. done-1 updated ahead in this backward
        self.key = None  # (hyper-parameters, gradient version) they were made with
        self.enabled = False  # the last step was neither clipped nor skipped
        self.stats = {"ahead": 0, "kept": 0, "undone": 0}
        opt.dp.on_final.append(self.final)

    @torch.no_grad()
    def final(self, i: int) -> None:
        """Bucket i's gradient is final: update it now (in bucket order, as step() would)."""
        opt, dp = self.opt, self.opt.dp
        sh = opt.shards[i]
        if not self.enabled or i != self.done or not sh.owns_master:
            return
        hp = dataclasses.replace(opt.hyper(), step=opt.step_count + 1)
        key = (hp, dp.grad_version)
        if self.done and key != self.key:
            return
        self.key = key
        opt.update_bucket(i, hp, step_t=opt.step_tensor(hp), close=False)
        sh.close(provisional=True)
        self.done += 1
        self.stats["ahead"] += 1

    @torch.no_grad()
    def settle(self, hp, clip_coef, found_inf) -> int:
        """At step(), after the step's own decisions: how many leading buckets stand updated."""
        clean = (clip_coef is None or float(clip_coef) >= 1.0) and (found_inf is None or not bool(found_inf))
        n, self.enabled = self.done, clean
        if not n:
            return 0
        if clean and self.key == (hp, self.opt.dp.grad_version):
            for i in range(n):
                self.opt.shards[i].keep()
            self.done, self.key = 0, None
            self.stats["kept"] += n
            return n
        self.discard()
        return 0

    @torch.no_grad()
    def discard(self) -> None:
        """Undo the early updates: the host still holds the old state; the parameters they wrote
        are rebuilt from the old masters (rounded as the publish rounds them)."""
        if not self.done:
            return
        opt = self.opt
        for i in range(self.done):
            sh = opt.shards[i]
            opt.dp.before_update(i)
            sh.open()
            opt.dp.param_slice(i).copy_(sh.master)
            sh.close(changed=False)
        self.stats["undone"] += self.done
        self.done, self.key, self.enabled = 0, None, False  # not again until a step goes through


@torch.no_grad()
def offload_optimizer(opt, overlap: bool = True) -> HostState:
    """Move a freshly built ZeroAdamW's state to the host (its shards replaced by HostShards);
    overlap: update buckets during backward (EarlyUpdates, opt.early). Returns the HostState
    (copy statistics, host bytes)."""
    device = opt.dp.buckets[0].data.device
    state = HostState(device)
    for i, st in enumerate(opt.shards):
        sh = HostShard(state, i, st)
        state.shards.append(sh)
        opt.shards[i] = sh
    opt.offload = state
    if overlap and opt.dp.zero3 is None:
        opt.early = EarlyUpdates(opt)
    return state
