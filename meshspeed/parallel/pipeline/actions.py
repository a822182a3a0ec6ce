"""The vocabulary of a pipeline schedule: one frozen Action per step a rank takes.

A schedule is plain data, `list[list[Action]]` indexed by rank, so it can be printed, simulated,
drawn, compared in tests and executed by a small runtime without any of those knowing how it
was produced.

Stage placement is one of two (a schedule declares which, schedules.py):
- "loop", Megatron's interleaved layout: with `vpp` chunks per rank, virtual stage
  `s = chunk * pp + rank`, so rank r holds stages r, r+pp, r+2pp, ...  Activations flow
  rank 0 -> 1 -> ... -> pp-1 -> 0 (next chunk) -> ..., and gradients the other way round.
- "v", the V of DualPipeV (and torch.distributed.pipelining's "v" style): odd chunks run the
  ranks backwards, `s = chunk * pp + (pp - 1 - rank)` for odd chunks, so with vpp = 2 rank r
  holds stages r and 2pp-1-r: activations go down the ranks and come back up, the hand-off at
  the bottom of the V stays on rank pp-1, and rank 0 holds both the embedding and the loss.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Compute kinds. For schedules that split the backward (zero-bubble), B is the input-gradient part
# and W the weight-gradient part; everywhere else B is the full backward and there is no W.
F, B, W = "F", "B", "W"
# Communication kinds: activations travel forward (SEND_F/RECV_F), gradients backward (SEND_B/RECV_B).
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"

COMPUTE_KINDS = (F, B, W)
COMM_KINDS = (SEND_F, RECV_F, SEND_B, RECV_B)
# Short prefixes keep a printed rank schedule on one readable line: "sF3.1>2" = send the output of
# F3.1 to rank 2, "rB3.0<1" = receive the gradient for B3.0 from rank 1.
_COMM_PREFIX = {SEND_F: "sF", RECV_F: "rF", SEND_B: "sB", RECV_B: "rB"}
_PREFIX_COMM = {v: k for k, v in _COMM_PREFIX.items()}


class ScheduleError(ValueError):
    """A schedule's arguments or contents are wrong; the message says which and what would work.

    `microbatches`: a micro-batch count that would work, when that is the fix. The caller words
    the hint in its own settings (`--microbatches` for `meshspeed pipeline`, the global batch
    size for the trainer), so no caller rewrites another's message."""

    def __init__(self, message: str, microbatches: int | None = None):
        super().__init__(message)
        self.microbatches = microbatches


@dataclass(frozen=True, order=True)
class Action:
    """One step of one rank.

    kind: F, B, W or a communication kind.
    microbatch: microbatch index (0-based).
    chunk: the local model chunk (virtual stage `chunk * pp + rank`) the step belongs to. For a
        RECV it is the chunk that consumes the data, for a SEND the chunk that produced it.
    peer: the other rank of a communication action; None for compute.
    """

    kind: str
    microbatch: int
    chunk: int = 0
    peer: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in COMPUTE_KINDS + COMM_KINDS:
            raise ScheduleError(
                f"action kind {self.kind!r} is unknown; valid kinds: {', '.join(COMPUTE_KINDS + COMM_KINDS)}"
            )
        if (self.peer is None) != (self.kind in COMPUTE_KINDS):
            raise ScheduleError(
                f"action {self.kind} {self.microbatch}.{self.chunk}: communication actions need a peer rank, "
                "compute actions must not have one"
            )

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    def compact(self, show_chunk: bool = True) -> str:
        """'F3.1' (forward, microbatch 3, chunk 1); 'F3' with show_chunk=False (vpp == 1)."""
        chunk = f".{self.chunk}" if show_chunk else ""
        if self.is_compute:
            return f"{self.kind}{self.microbatch}{chunk}"
        arrow = ">" if self.kind in (SEND_F, SEND_B) else "<"
        return f"{_COMM_PREFIX[self.kind]}{self.microbatch}{chunk}{arrow}{self.peer}"

    def __str__(self) -> str:
        return self.compact()


_ACTION_RE = re.compile(r"^(F|B|W|sF|rF|sB|rB)(\d+)(?:\.(\d+))?(?:([<>])(\d+))?$")


def parse_action(text: str) -> Action:
    """Inverse of Action.compact: 'F3.1', 'B0', 'sF3.1>2', 'rB0<1'."""
    match = _ACTION_RE.match(text.strip())
    if not match:
        raise ScheduleError(
            f"cannot parse action {text!r}; expected e.g. 'F3.1', 'B0', 'W2.1', 'sF3.1>2', 'rB0.0<1'"
        )
    kind, mb, chunk, arrow, peer = match.groups()
    if kind in _PREFIX_COMM:
        kind = _PREFIX_COMM[kind]
        if peer is None:
            raise ScheduleError(f"communication action {text!r} needs a peer, e.g. '{text}>1'")
    elif peer is not None:
        raise ScheduleError(f"compute action {text!r} cannot have a peer")
    return Action(kind, int(mb), int(chunk or 0), None if peer is None else int(peer))


PLACEMENTS = ("loop", "v")


def check_placement(placement: str) -> None:
    if placement not in PLACEMENTS:
        raise ScheduleError(f"stage placement {placement!r} is unknown; valid: {', '.join(PLACEMENTS)}")


def stage_of(rank: int, chunk: int, pp: int, placement: str = "loop") -> int:
    """Virtual stage held by `rank` as its `chunk`-th model chunk."""
    if placement == "v" and chunk % 2:
        return chunk * pp + pp - 1 - rank
    return chunk * pp + rank


def holder_of(stage: int, pp: int, placement: str = "loop") -> tuple[int, int]:
    """(rank, chunk) holding virtual stage `stage`."""
    chunk, offset = divmod(stage, pp)
    if placement == "v" and chunk % 2:
        return pp - 1 - offset, chunk
    return offset, chunk


def format_rank(actions: list[Action], show_chunk: bool = True) -> str:
    return " ".join(a.compact(show_chunk) for a in actions)


def format_schedule(schedule: list[list[Action]], show_chunk: bool = True) -> str:
    """One line per rank: 'rank 0: F0 F1 F2 B0 ...'."""
    width = len(str(len(schedule) - 1))
    return "\n".join(f"rank {r:>{width}}: {format_rank(acts, show_chunk)}" for r, acts in enumerate(schedule))


def parse_schedule(lines: str | list[str]) -> list[list[Action]]:
    """Read back format_schedule's output (or one space-separated action list per rank)."""
    if isinstance(lines, str):
        lines = [ln for ln in lines.splitlines() if ln.strip()]
    out = []
    for line in lines:
        body = line.split(":", 1)[1] if ":" in line else line
        out.append([parse_action(tok) for tok in body.split()])
    return out
