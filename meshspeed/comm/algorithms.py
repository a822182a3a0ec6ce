"""Collective algorithms built from point-to-point exchanges.

Every function works on flat, contiguous 1-D buffers and on a *view* of the group: `members`
(group-member indices in ring order) and `me` (this rank's position in that list). Views let
the hierarchical all-reduce run rings over "the ranks of my node" and "my peers on other
nodes" without creating extra process groups. Chunks follow torch.tensor_split's convention
(the first n % p chunks get one extra element), so no size has to divide the world size.
"""

from __future__ import annotations

import torch

from meshspeed.comm.group import Lane


def bounds(n: int, parts: int) -> list[int]:
    """Offsets of `parts` chunks of n elements, tensor_split style: len(parts) + 1 entries."""
    base, rem = divmod(n, parts)
    offs = [0]
    for i in range(parts):
        offs.append(offs[-1] + base + (1 if i < rem else 0))
    return offs


def chunks(x: torch.Tensor, offs: list[int]) -> list[torch.Tensor]:
    return [x[offs[i] : offs[i + 1]] for i in range(len(offs) - 1)]


def reduce_into(dst: torch.Tensor, src: torch.Tensor, op: str) -> None:
    """dst = dst (op) src. avg is a sum here; the caller divides once at the end."""
    if op in ("sum", "avg"):
        dst.add_(src)
    elif op == "max":
        torch.maximum(dst, src, out=dst)
    elif op == "min":
        torch.minimum(dst, src, out=dst)
    else:
        raise ValueError(f"unsupported reduce op {op!r}")


# ---------------------------------------------------------------------------------------- ring
def ring_reduce_scatter(
    lane: Lane, members: list[int], me: int, parts: list[torch.Tensor], op: str
) -> torch.Tensor:
    """Reduce p chunks across the ring; returns the reduced chunk `me` (a new tensor).

    Step k sends the running sum of chunk (me-k-1) right and receives chunk (me-k-2) from the
    left, so after p-1 steps chunk `me` has visited every rank. The input is only read.
    """
    p = len(members)
    if p == 1:
        return parts[0].clone()
    right, left = members[(me + 1) % p], members[(me - 1) % p]
    send = parts[(me - 1) % p]
    for k in range(p - 1):
        r = (me - k - 2) % p
        acc = torch.empty_like(parts[r])
        lane.exchange(send, right, acc, left)
        reduce_into(acc, parts[r], op)
        send = acc
    return send


def ring_all_gather(lane: Lane, members: list[int], me: int, parts: list[torch.Tensor]) -> None:
    """Fill every chunk of `parts` (views of the output) given that chunk `me` is filled."""
    p = len(members)
    right, left = members[(me + 1) % p], members[(me - 1) % p]
    for k in range(p - 1):
        lane.exchange(parts[(me - k) % p], right, parts[(me - k - 1) % p], left)


def ring_all_reduce(lane: Lane, members: list[int], me: int, x: torch.Tensor, op: str) -> None:
    """In place: reduce-scatter then all-gather around the ring (2(p-1) steps)."""
    p = len(members)
    if p == 1:
        return
    parts = chunks(x, bounds(x.numel(), p))
    mine = ring_reduce_scatter(lane, members, me, parts, op)
    parts[me].copy_(mine)
    ring_all_gather(lane, members, me, parts)


# ---------------------------------------------------------------------- halving-doubling (Rabenseifner)
def hd_all_reduce(lane: Lane, members: list[int], me: int, x: torch.Tensor, op: str) -> None:
    """In place: recursive vector halving (reduce-scatter) then doubling (all-gather).

    Any p: with p2 the largest power of two ≤ p and r = p - p2, the first 2r ranks pair up
    first (evens hand their vector to the next odd rank and sit out), leaving p2 participants;
    the evens get the result back at the end. This is the MPICH scheme.
    """
    p = len(members)
    if p == 1:
        return
    p2 = 1 << (p.bit_length() - 1)
    r = p - p2
    if me < 2 * r and me % 2 == 0:
        lane.exchange(x, members[me + 1], None, None)
        lane.skip(2 * (p2.bit_length() - 1))  # keep tags in step with the partner's halving/doubling
        lane.exchange(None, None, x, members[me + 1])
        return
    if me < 2 * r:
        tmp = torch.empty_like(x)
        lane.exchange(None, None, tmp, members[me - 1])
        reduce_into(x, tmp, op)
        nr = me // 2
    else:
        nr = me - r
        lane.skip(1 if r else 0)  # the pairing step the first 2r ranks spent

    def real(q: int) -> int:
        return members[2 * q + 1] if q < r else members[q + r]

    offs = bounds(x.numel(), p2)
    lo, hi, d = 0, p2, p2 // 2
    while d >= 1:  # halving: keep the half of the block range our bit selects
        partner, mid = real(nr ^ d), (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if nr & d == 0 else ((mid, hi), (lo, mid))
        kept = x[offs[keep[0]] : offs[keep[1]]]
        incoming = torch.empty_like(kept)
        lane.exchange(x[offs[give[0]] : offs[give[1]]], partner, incoming, partner)
        reduce_into(kept, incoming, op)
        lo, hi = keep
        d //= 2
    d = 1
    while d < p2:  # doubling: swap finished ranges with the partner, mirror of the halving
        partner, size = real(nr ^ d), hi - lo
        other, new = ((hi, hi + size), (lo, hi + size)) if nr & d == 0 else ((lo - size, lo), (lo - size, hi))
        lane.exchange(x[offs[lo] : offs[hi]], partner, x[offs[other[0]] : offs[other[1]]], partner)
        lo, hi = new
        d *= 2
    if me < 2 * r:  # odd partner of a rank that sat out: give it the result
        lane.exchange(x, members[me - 1], None, None)


# ---------------------------------------------------------------------------------- hierarchical
def hier_all_reduce(
    lane: Lane, members: list[int], nodes: list[int], me: int, x: torch.Tensor, op: str
) -> None:
    """In place: intra-node reduce-scatter → inter-node all-reduce of my chunk → intra-node all-gather.

    Only 1/k of the buffer crosses the slow inter-node links (k = ranks per node), which is
    what makes it win on clusters. `nodes[i]` is the node of members[i].
    """
    by_node: dict[int, list[int]] = {}
    for m, n in zip(members, nodes):
        by_node.setdefault(n, []).append(m)
    node_ids = sorted(by_node)
    local = by_node[nodes[me]]
    li = local.index(members[me])
    peers = [by_node[nid][li] for nid in node_ids]  # same local index on every node
    ni = node_ids.index(nodes[me])
    parts = chunks(x, bounds(x.numel(), len(local)))
    mine = ring_reduce_scatter(lane, local, li, parts, op)
    ring_all_reduce(lane, peers, ni, mine, op)
    parts[li].copy_(mine)
    ring_all_gather(lane, local, li, parts)


# ----------------------------------------------------------------------------------------- Bruck
def _bruck_steps(p: int) -> list[tuple[int, int]]:
    steps, d = [], 1
    while d < p:
        steps.append((d, min(d, p - d)))
        d *= 2
    return steps


def bruck_all_gather(
    lane: Lane, members: list[int], me: int, mine: torch.Tensor, sizes: list[int]
) -> list[torch.Tensor]:
    """⌈log2 p⌉ steps for any p. Returns the p blocks in member order.

    Invariant: blocks[i] holds the block of member (me + i) % p. Step with distance d sends our
    first cnt blocks to me - d and appends the first cnt blocks of me + d.
    """
    p = len(members)
    blocks = [mine]
    for d, cnt in _bruck_steps(p):
        send = blocks[0] if cnt == 1 else torch.cat(blocks[:cnt])
        rsizes = [sizes[(me + d + j) % p] for j in range(cnt)]
        recv = torch.empty(sum(rsizes), dtype=mine.dtype, device=mine.device)
        lane.exchange(send, members[(me - d) % p], recv, members[(me + d) % p])
        blocks.extend(recv.split(rsizes))
    out: list[torch.Tensor] = [mine] * p
    for i, b in enumerate(blocks):
        out[(me + i) % p] = b
    return out


def bruck_reduce_scatter(
    lane: Lane, members: list[int], me: int, parts: list[torch.Tensor], op: str
) -> torch.Tensor:
    """The transpose of bruck_all_gather: the same steps in reverse, sending the other way and
    summing instead of copying, so every message has the all-gather's size. Returns chunk me."""
    p = len(members)
    acc = [parts[(me + i) % p] for i in range(p)]  # acc[i]: partial sum of member (me+i)'s chunk
    if p == 1:
        return acc[0].clone()
    for d, cnt in reversed(_bruck_steps(p)):
        send = acc[d] if cnt == 1 else torch.cat(acc[d : d + cnt])
        rsizes = [acc[j].numel() for j in range(cnt)]
        recv = torch.empty(sum(rsizes), dtype=send.dtype, device=send.device)
        lane.exchange(send, members[(me + d) % p], recv, members[(me - d) % p])
        for j, part in enumerate(recv.split(rsizes)):
            reduce_into(part, acc[j], op)  # the received buffer becomes the accumulator
            acc[j] = part
    return acc[0]


# ------------------------------------------------------------------------------------ all-to-all
def pairwise_all_to_all(
    lane: Lane, members: list[int], me: int, send: list[torch.Tensor], recv: list[torch.Tensor]
) -> None:
    """p-1 steps; at step k send to me+k and receive from me-k, so every pair meets once."""
    p = len(members)
    recv[me].copy_(send[me])
    for k in range(1, p):
        dst, src = (me + k) % p, (me - k) % p
        lane.exchange(send[dst], members[dst], recv[src], members[src])
