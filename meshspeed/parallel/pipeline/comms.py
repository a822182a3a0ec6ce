"""Insert the SEND/RECV actions a compute-only schedule implies.

What travels: the forward output of virtual stage s goes to the holder of s+1 (SEND_F/RECV_F);
the input gradient computed by B at stage s goes to the holder of s-1 (SEND_B/RECV_B). W sends
nothing. Hand-offs between two chunks on the same rank (pp == 1 with vpp > 1, the bottom of a
"v" placement) need no message. Who holds a stage is the schedule's placement (actions.py).

The rule, and why it cannot deadlock (sends non-blocking, receives blocking):

1. A SEND goes right after the compute that produced the tensor. Sends never block, so a rank
   never waits on its own sends.
2. On every ordered pair of ranks (src -> dst), dst receives in exactly the order src sends.
   Order-matched transports (NCCL, HCCL) pair the k-th send with the k-th receive regardless of
   tags, so any other order would hand a tensor to the wrong microbatch.
3. Each RECV sits immediately before the first compute on dst that needs it *or any later
   message of the same channel*. Receiving message k earlier than its consumer costs nothing:
   src sent k before the message j that is actually needed there, so when j has arrived k has too.

Hence a rank blocks only at a point where the compute-only schedule would block anyway, and the
comm schedule deadlocks exactly when the compute order has a cycle (F of s on rank a waiting for
a gradient that rank b only produces after a forward it needs from a). validate() finds those
by simulation. A runtime may post each receive earlier (irecv) and wait at the recorded spot.
"""

from __future__ import annotations

from collections import defaultdict

from meshspeed.parallel.pipeline.actions import (
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    holder_of,
    stage_of,
)


def message_of(
    action: Action, rank: int, pp: int, vpp: int, placement: str = "loop"
) -> tuple[str, int, int, int] | None:
    """(send kind, dst rank, dst chunk, microbatch) of what `action` must send, or None.

    None for W, for the ends of the pipeline, and for same-rank hand-offs."""
    stage = stage_of(rank, action.chunk, pp, placement)
    if action.kind == F and stage + 1 < pp * vpp:
        dst, dst_chunk = holder_of(stage + 1, pp, placement)
        kind = SEND_F
    elif action.kind == B and stage > 0:
        dst, dst_chunk = holder_of(stage - 1, pp, placement)
        kind = SEND_B
    else:
        return None
    return None if dst == rank else (kind, dst, dst_chunk, action.microbatch)


def has_comms(schedule: list[list[Action]]) -> bool:
    return any(not a.is_compute for acts in schedule for a in acts)


def insert_comms(
    schedule: list[list[Action]], pp: int, vpp: int, placement: str = "loop"
) -> list[list[Action]]:
    """Return a new schedule with SEND/RECV actions placed by the rule in the module docstring.
    Communication actions already present are dropped and re-derived."""
    compute = [[a for a in acts if a.is_compute] for acts in schedule]
    out: list[list[Action]] = [[] for _ in compute]
    # channel (src, dst) -> received actions in send order
    channels: dict[tuple[int, int], list[Action]] = defaultdict(list)
    for rank, acts in enumerate(compute):
        for a in acts:
            out[rank].append(a)
            msg = message_of(a, rank, pp, vpp, placement)
            if msg is None:
                continue
            kind, dst, dst_chunk, mb = msg
            out[rank].append(Action(kind, mb, a.chunk, dst))
            channels[(rank, dst)].append(Action(RECV_F if kind == SEND_F else RECV_B, mb, dst_chunk, rank))

    # Where each receive goes: before compute index q on dst (see rule 3).
    before: list[dict[int, list[Action]]] = [defaultdict(list) for _ in compute]
    for (src, dst), recvs in sorted(channels.items()):
        position = {(a.kind, a.microbatch, a.chunk): i for i, a in enumerate(compute[dst])}
        need = [
            position.get((F if r.kind == RECV_F else B, r.microbatch, r.chunk), len(compute[dst]))
            for r in recvs
        ]
        # suffix minimum: message k must be in hand before any later message of the channel is used
        for k in range(len(need) - 2, -1, -1):
            need[k] = min(need[k], need[k + 1])
        for r, q in zip(recvs, need):
            before[dst][q].append(r)

    final: list[list[Action]] = []
    for rank, acts in enumerate(out):
        merged: list[Action] = []
        i = 0  # index among this rank's compute actions
        for a in acts:
            if a.is_compute:
                merged += before[rank].get(i, [])
                i += 1
            merged.append(a)
        merged += before[rank].get(i, [])  # receives with no consumer (incomplete schedule)
        final.append(merged)
    return final
