"""The pipeline runtime's point-to-point: receives posted ahead, sends fire-and-forget.

Every message between stages is one tensor of a statically known shape, the activations
[micro, carry + seq(/tp with sequence parallelism), dim] forward (carry: rows a family packs
ahead of the sequence, PipelineUnits) and their gradients backward, so a
receive buffer is allocated and posted (irecv) before the data is needed and the runtime only
waits at the point the schedule placed the RECV. Sends are isend; their handles are reaped
as they complete and all waited at the end of the step. Peers are pp-group member indices,
which are the pipeline ranks (mesh.py puts pp outermost). Tag 0 everywhere: order-matched
transports (NCCL, HCCL) ignore tags, and the schedule's per-channel order makes the k-th
send meet the k-th receive (comms.py).
"""

from __future__ import annotations

import torch

from meshspeed import comm


class StageComm:
    def __init__(self, group: comm.Group, device: torch.device | str):
        self.group, self.device = group, device
        self._recvs: dict[object, tuple[object, torch.Tensor]] = {}
        self._sends: list[tuple[object, torch.Tensor]] = []

    def post_recv(self, key, peer: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Start receiving the message `key` (any hashable id) from member `peer`."""
        if key in self._recvs:
            raise RuntimeError(f"pipeline: receive {key} posted twice")
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        self._recvs[key] = (comm.irecv(buf, self.group, peer), buf)

    def posted(self, key) -> bool:
        return key in self._recvs

    def take(self, key) -> torch.Tensor:
        """Wait for the message `key` (posted earlier) and return its buffer."""
        handle, buf = self._recvs.pop(key)
        handle.wait()
        return buf

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        tensor = tensor.detach().contiguous()
        self._sends.append((comm.isend(tensor, self.group, peer), tensor))
        if len(self._sends) > 8:  # reap finished sends so their buffers can go
            done = [(h, t) for h, t in self._sends if h.is_completed()]
            for h, _ in done:
                h.wait()  # instant; closes its flight-recorder entry
            self._sends = [(h, t) for h, t in self._sends if not any(h is d for d, _ in done)]

    def drain(self) -> None:
        """Wait for every send (end of step); receives must all have been taken."""
        for h, _ in self._sends:
            h.wait()
        self._sends = []
        if self._recvs:
            left = ", ".join(map(str, list(self._recvs)[:4]))
            self._recvs.clear()
            raise RuntimeError(f"pipeline: receives posted but never used: {left}")
