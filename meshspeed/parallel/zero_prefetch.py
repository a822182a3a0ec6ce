"""ZeRO-1/2: the all-gather of updated parameters overlapped with the next forward.

Without this, ZeroAdamW.step() issues one all-gather per bucket (each rank's updated 1/dp
slice into every rank's parameter buffer) and waits for all of them before returning: the
gather is on the critical path between steps. With `enable_zero_prefetch(dp)`:

- DataParallel.publish hands the bucket to `ZeroPrefetch.publish` instead of gathering it;
  once the step has published the last bucket, the gathers are issued asynchronously in
  forward order (buckets are packed in reverse registration order, so from the last bucket
  down to bucket 0), and step() returns at once.
- A forward pre-hook on every module that holds parameters directly waits, just before that
  module runs, for the buckets holding its parameters (Parameter identity, so a tied weight
  is waited on by whichever module uses it first). The first layers wait for the first
  gathers while the later ones are still on the wire.
- Anything else that reads the parameters between step() and the next forward (saving a
  checkpoint, exporting, a norm over the weights) calls `wait()` first. A bucket's next
  publish waits for its previous gather (a parameter no module ran, say).

Bit-identical to the blocking gather: the same bytes land in the same buffers, only later.
"""

from __future__ import annotations

import torch
from torch import nn

from meshspeed import comm


class ZeroPrefetch:
    def __init__(self, dp):
        self.dp = dp
        self.pending: dict[int, comm.Handle] = {}  # bucket -> in-flight all-gather
        self._queued: dict[int, torch.Tensor] = {}  # bucket -> this rank's updated slice
        self.stats = {"issued": 0, "waited_in_forward": 0, "waited_outside": 0}
        of_param = {id(dp.params[s.name]): s.bucket for s in dp.slots.values()}
        self._hooks = []
        for module in dp.module.modules():
            mine = sorted({of_param[id(p)] for p in module.parameters(recurse=False) if id(p) in of_param})
            if mine:
                self._hooks.append(module.register_forward_pre_hook(self._hook(mine)))

    def _hook(self, buckets: list[int]):
        def pre_forward(module: nn.Module, args) -> None:
            for i in buckets:
                if self._wait(i):
                    self.stats["waited_in_forward"] += 1

        return pre_forward

    def _wait(self, i: int) -> bool:
        h = self.pending.pop(i, None)
        if h is not None:
            h.wait()
        return h is not None

    def wait_bucket(self, i: int) -> None:
        """Before the optimizer rewrites bucket i's slice (the source of its gather, in place)."""
        if self._wait(i):
            self.stats["waited_outside"] += 1

    def publish(self, i: int, src: torch.Tensor) -> None:
        """Called by DataParallel.publish for bucket i (0, 1, ... in step order); `src`, this
        rank's slice of the bucket, is gathered in place into the bucket."""
        self.wait_bucket(i)  # the previous gather into this buffer must land first
        self._queued[i] = src
        # buckets whose group is one rank (experts with edp 1) are never published
        if len(self._queued) == sum(self.dp.group_of(j).size > 1 for j in range(len(self.dp.buckets))):
            for j in sorted(self._queued, reverse=True):  # forward order: the input side first
                out, group = self.dp.buckets[j].data, self.dp.group_of(j)
                self.pending[j] = comm.all_gather(self._queued[j], group, out=out, async_op=True)
                self.stats["issued"] += 1
            self._queued.clear()

    def wait(self) -> None:
        """Every parameter up to date (before a checkpoint, an export, or any read outside forward)."""
        for i in list(self.pending):
            if self._wait(i):
                self.stats["waited_outside"] += 1

    def remove(self) -> None:
        """Back to the blocking gather (after waiting for what is in flight)."""
        self.wait()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if getattr(self.dp, "prefetch", None) is self:
            self.dp.prefetch = None


def enable_zero_prefetch(dp) -> ZeroPrefetch | None:
    """Overlap dp's post-step parameter all-gather with the next forward. A no-op (None) without
    ZeRO, with one dp rank, or at ZeRO-3 (zero3.py gathers before each block), where step()
    gathers nothing."""
    if not dp.zero or dp.zero == 3 or dp.group.size == 1:
        return None
    if getattr(dp, "prefetch", None) is None:
        dp.prefetch = ZeroPrefetch(dp)
    return dp.prefetch
