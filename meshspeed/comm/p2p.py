"""Point-to-point: send/recv, their async forms, and batched exchanges.

Peers are member indices of the group (like every other meshspeed call), not global ranks.
Transfers are recorded in the flight recorder (seq -1: p2p has no group-wide order) and
waits enforce the context's timeout, naming the peer that never showed up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshspeed.comm.errors import ConfigError
from meshspeed.comm.group import Group, Stall, wait_work
from meshspeed.comm.trace import FlightRecorder, dtype_name


@dataclass
class P2P:
    """One transfer of a batch: kind "send" or "recv", the tensor, the peer's member index."""

    kind: str
    tensor: torch.Tensor
    peer: int
    tag: int = 0


class P2PHandle:
    def __init__(self, group: Group, works: list, ops: list[P2P], entries: list[dict]):
        self._group, self._works, self._ops, self._entries = group, works, ops, entries
        self._deadline = group.p2p_deadline()
        self._done: set[int] = set()

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def wait(self, kind: str | None = None) -> None:
        """Wait for every transfer, or only those of `kind` ("recv": a caller that must not
        block on its own sends). A backend that coalesced the batch into one work waits all."""
        coalesced = len(self._works) != len(self._ops)
        for i, (work, op, entry) in enumerate(zip(self._works, self._ops, self._entries)):
            if i in self._done or (kind is not None and op.kind != kind and not coalesced):
                continue
            self._done.add(i)  # waiting a completed gloo receive again hung (seen): once only
            try:
                wait_work(work, self._deadline, self._group.plain_wait)
            except Stall as stall:
                FlightRecorder.finish(entry, "timed_out")
                raise self._group.p2p_timeout(op.kind, op.peer, stall.cause) from None
            FlightRecorder.finish(entry)


def _check(group: Group, op: P2P) -> None:
    if op.kind not in ("send", "recv"):
        raise ConfigError(f"p2p kind {op.kind!r} must be 'send' or 'recv'")
    if not 0 <= op.peer < group.size or op.peer == group.rank:
        raise ConfigError(
            f"p2p peer {op.peer} must be another member index of {group.name} (0..{group.size - 1})"
        )
    if not op.tensor.is_contiguous():
        raise ConfigError("p2p tensors must be contiguous (the backend writes the bytes in place)")


def batch(ops: list[P2P], group: Group) -> P2PHandle:
    """Post every transfer at once (required by NCCL for rings of send/recv) and return one handle."""
    for op in ops:
        _check(group, op)
    entries = [
        group.ctx.recorder.record(
            -1,
            group.name,
            f"{op.kind}->{group.ranks[op.peer]}" if op.kind == "send" else f"recv<-{group.ranks[op.peer]}",
            op.tensor.shape,
            dtype_name(op.tensor.dtype),
            "p2p",
            op.tensor.numel() * op.tensor.element_size(),
        )
        for op in ops
    ]
    torch_ops = [
        dist.P2POp(
            dist.isend if op.kind == "send" else dist.irecv, op.tensor, group.ranks[op.peer], group.pg, op.tag
        )
        for op in ops
    ]
    works = dist.batch_isend_irecv(torch_ops) if torch_ops else []
    return P2PHandle(group, works, ops, entries)


def isend(tensor: torch.Tensor, group: Group, dst: int, tag: int = 0) -> P2PHandle:
    return batch([P2P("send", tensor, dst, tag)], group)


def irecv(tensor: torch.Tensor, group: Group, src: int, tag: int = 0) -> P2PHandle:
    return batch([P2P("recv", tensor, src, tag)], group)


def send(tensor: torch.Tensor, group: Group, dst: int, tag: int = 0) -> None:
    isend(tensor, group, dst, tag).wait()


def recv(tensor: torch.Tensor, group: Group, src: int, tag: int = 0) -> torch.Tensor:
    irecv(tensor, group, src, tag).wait()
    return tensor
