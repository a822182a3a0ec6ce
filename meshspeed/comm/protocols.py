"""What a Group needs from its context, and what the desync checks need from a Group.

These are structural types (typing.Protocol), so `group.py` and `desync.py` can name the
objects they receive without importing the modules that define them: the import graph of
meshspeed.comm stays a tree (context -> group -> desync -> protocols), with no cycle even under
`if TYPE_CHECKING`.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from meshspeed.comm.trace import FlightRecorder


class CommView(Protocol):
    """The parts of a CommContext a Group uses."""

    rank: int
    world_size: int
    backend: str
    timeout_s: float
    debug: bool
    device: torch.device
    recorder: FlightRecorder
    forced_algos: dict
    link_params: Any

    def node_of(self, rank: int) -> int: ...

    def prefixed_store(self, prefix: str) -> Any: ...

    def dump_trace(self) -> str | None: ...


class GroupView(Protocol):
    """The parts of a Group the desync check and the timeout diagnosis use."""

    ctx: CommView
    ranks: list[int]
    rank: int
    size: int
    name: str
    store: Any
