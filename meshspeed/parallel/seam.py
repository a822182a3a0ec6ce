"""The seam between two module meshes: a producer's rows re-sliced to what a consumer needs
forward, their gradients returned to the ranks that produced them backward.

A vision-language model's encoder yields `rows` (one per image: [n_img, n_tok, dim]) split over
its own dp; the decoder needs, on each of its ranks, the rows of its own dp slice. The two
layouts differ in degrees (colocated: encoder dp 4, decoder tp 2 x dp 2 on the same 4 ranks) or
in ranks (disaggregated: encoder on 0-1, decoder on 2-3). Either way the seam is one routing
table over global ranks, built from the two ModuleMeshes, and one batch of point-to-point
transfers each way (comm.p2p; a rank's rows for itself are copied, not sent):

    forward   producer block j (rows Shard(0) over the producer's dp) -> every consumer rank
              whose dp slice overlaps it; one replica of the block sends (its tp/cp peers hold
              the same rows); consumer tp and cp peers all receive (fan-out), and a consumer dp
              rank gathers its slice from every block it overlaps (fan-in).
    backward  the gradient's placement over the consumer's tp is Replicate (the tp layers'
              copy_to already summed it: every tp peer holds the full, identical gradient of the
              rows), so tp peer t returns only piece t of its slice: sending all of it from
              every peer would count it tp times. Over cp it is Partial (each cp rank saw only
              its positions): every cp peer returns its piece and the producer sums. Each
              returned piece goes to every replica of the producing block (the producer's tp
              peers each need the whole gradient of their replicated output), and the producer
              sums what arrives per row.

Only the producer's last pipeline stage produces and the consumer's first consumes: a decoder
pipeline is covered by the trainer's parity tests (tests/train/test_vlm_modules.py), where every
micro-batch's transfers are posted when the step begins (train/modules_run.EncoderSide). A
producer pipeline and cp on either side are routed as described but refused until a parity test
covers them.

Overlap: `start` posts every transfer of the forward at once (sends and receives, one batch:
NCCL needs both directions in one group call) and returns; the consumer's own work placed
between `start` and `wait` (its text embedding, say) runs while the rows are in flight. Sends
are never waited where they are posted: a producer goes on to its next micro-batch, a consumer
goes on with its backward; they are completed at the seam's next call or at `flush()`. In
backward, `wait`'s node posts the gradient sends and returns at once; `start`'s node receives.

The gradient returned is that of the consumer's loss as the consumer computed it. When the
consumer averages gradients over its dp (mean loss per rank), the producer's parameter
gradients must be summed over the producer's dp group and divided by the *consumer's* dp:
`producer_grad_divisor` says by how much (reduce_producer_grads does it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from meshspeed.comm import collectives as C
from meshspeed.comm.errors import ConfigError
from meshspeed.comm.group import Group
from meshspeed.comm.module_mesh import ModuleMesh
from meshspeed.comm.p2p import P2P, batch
from meshspeed.comm.placement import chunk_bounds


@dataclass
class _Route:
    """One call's transfers for a given row count, from this rank's point of view."""

    src_rows: tuple[int, int] | None  # the producer block this rank holds (any replica), or None
    dst_rows: tuple[int, int] | None  # the consumer slice this rank needs, or None
    fwd_send: list[tuple[int, int, int]] = field(default_factory=list)  # (peer, lo, hi) global rows
    fwd_recv: list[tuple[int, int, int]] = field(default_factory=list)
    bwd_send: list[tuple[int, int, int]] = field(default_factory=list)
    bwd_recv: list[tuple[int, int, int]] = field(default_factory=list)


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


class Seam:
    """Rows [n, *row_shape] split over the producer's dp, delivered to the consumer's dp slices.

    `group`: a group holding every rank of both modules (peers are its member indices); by
    default one made for the seam, so its transfers never interleave with another layer's."""

    def __init__(self, producer: ModuleMesh, consumer: ModuleMesh, group: Group | None = None):
        for m, pp in ((producer, producer.dims.pp), (consumer, 1)):
            # The routing takes a producer's last stage and a consumer's first, and sums cp peers'
            # gradients (Partial); no parity test covers a producer pipeline or cp yet: refused.
            if m.dims.cp > 1 or pp > 1:
                raise ConfigError(
                    f"modules.{m.name}: pp={m.dims.pp}, cp={m.dims.cp} at the seam is not built yet; "
                    f"use cp = 1{' and pp = 1' if pp > 1 else ''}"
                )
        self.producer, self.consumer = producer, consumer
        ctx = producer.ctx
        if group is None:
            union = sorted(set(producer.ranks) | set(consumer.ranks))
            others = [[r] for r in range(ctx.world_size) if r not in union]
            group = ctx.split([union] + others, f"seam.{producer.name}.{consumer.name}")
        self.group = group
        self.me = ctx.rank
        self._routes: dict[int, _Route] = {}
        self._pending: list = []  # posted sends (handle, tensors kept alive) not yet waited

    # -- routing ------------------------------------------------------------------------
    def _blocks(self, n: int) -> list[tuple[tuple[int, int], list[int]]]:
        """Per producer dp index: its rows and the global ranks holding them (last stage),
        the sending replica first."""
        p = self.producer
        offs, out = chunk_bounds(n, p.dims.dp), []
        for j in range(p.dims.dp):
            holders = [r for r in p.ranks if (c := p.coords_of(r))["dp"] == j and c["pp"] == p.dims.pp - 1]
            out.append(((offs[j], offs[j + 1]), holders))
        return out

    def _slices(self, n: int) -> list[tuple[int, tuple[int, int], tuple[int, int]]]:
        """Per consumer rank of its first stage: (global rank, the rows it needs, the rows whose
        gradient it returns)."""
        c, out = self.consumer, []
        offs = chunk_bounds(n, c.dims.dp)
        for r in c.ranks:
            k = c.coords_of(r)
            if k["pp"]:
                continue
            lo, hi = offs[k["dp"]], offs[k["dp"] + 1]
            # Replicate over tp: peer t returns piece t of the slice (each holds the whole).
            sub = chunk_bounds(hi - lo, c.dims.tp)
            out.append((r, (lo, hi), (lo + sub[k["tp"]], lo + sub[k["tp"] + 1])))
        return out

    def route(self, n: int) -> _Route:
        """The transfers of this rank for `n` rows (cached: the layouts do not change)."""
        if n in self._routes:
            return self._routes[n]
        blocks, slices, me = self._blocks(n), self._slices(n), self.me
        mine_src = next((rows for rows, holders in blocks if me in holders), None)
        mine_dst = next((need for r, need, _ in slices if r == me), None)
        rt = _Route(mine_src, mine_dst)
        for rows, holders in blocks:
            for r, need, back in slices:
                if (ov := _overlap(rows, need)) and holders[0] == me:
                    rt.fwd_send.append((r, *ov))
                if ov and r == me:
                    rt.fwd_recv.append((holders[0], *ov))
                if (ov := _overlap(rows, back)) and r == me:
                    rt.bwd_send += [(h, *ov) for h in holders]
                if ov and me in holders:
                    rt.bwd_recv.append((r, *ov))
        self._routes[n] = rt
        return rt

    # -- transfers ----------------------------------------------------------------------
    def flush(self) -> None:
        """Complete every send posted so far (their buffers may be reused after)."""
        for handle, _keep in self._pending:
            handle.wait()
        self._pending.clear()

    def _exchange(self, sends, recvs):
        """Post sends [(peer, tensor)] and receives [(peer, buffer)] as one batch; pairs with
        peer == me are the caller's copies. Returns a function that waits for the receives
        only: the sends complete at the next call or at flush()."""
        peer = self.group.ranks.index
        ops = [P2P("send", t.contiguous(), peer(r)) for r, t in sends if r != self.me]
        ops += [P2P("recv", b, peer(r)) for r, b in recvs if r != self.me]
        if not ops:
            return lambda: None
        handle = batch(ops, self.group)
        self._pending.append((handle, ops))  # ops hold the send tensors alive until then
        return lambda: handle.wait("recv")

    def post_forward(self, x: torch.Tensor, n: int) -> _InFlight:
        rt, row_shape = self.route(n), tuple(x.shape[1:])
        self.flush()
        lo_src = rt.src_rows[0] if rt.src_rows else 0
        lo_dst, hi_dst = rt.dst_rows if rt.dst_rows else (0, 0)
        out = x.new_empty((hi_dst - lo_dst,) + row_shape)  # [slice, *row_shape]
        for r, lo, hi in rt.fwd_recv:
            if r == self.me:  # rows this rank produced and also consumes: a copy
                out[lo - lo_dst : hi - lo_dst] = x[lo - lo_src : hi - lo_src]
        sends = [(r, x[lo - lo_src : hi - lo_src]) for r, lo, hi in rt.fwd_send]
        recvs = [(r, out[lo - lo_dst : hi - lo_dst]) for r, lo, hi in rt.fwd_recv]  # contiguous views
        return _InFlight(out, self._exchange(sends, recvs), rt, row_shape)

    def post_backward(self, g: torch.Tensor, rt: _Route, row_shape, like: torch.Tensor):
        """Send this consumer rank's gradient pieces, post the receives of its producer block's.
        Returns a function giving the producer block's summed gradient (None on a rank that
        produced nothing)."""
        lo_src, hi_src = rt.src_rows if rt.src_rows else (0, 0)
        lo_dst = rt.dst_rows[0] if rt.dst_rows else 0
        sends = [(r, g[lo - lo_dst : hi - lo_dst]) for r, lo, hi in rt.bwd_send]
        recvs = [(r, lo, hi, like.new_empty((hi - lo,) + row_shape)) for r, lo, hi in rt.bwd_recv]
        wait = self._exchange(sends, [(r, b) for r, _, _, b in recvs])

        def finish():
            wait()
            if rt.src_rows is None:
                return None
            grad = like.new_zeros((hi_src - lo_src,) + row_shape)
            for r, lo, hi, buf in recvs:  # in consumer-rank order: the same sum on every replica
                part = g[lo - lo_dst : hi - lo_dst] if r == self.me else buf
                grad[lo - lo_src : hi - lo_src] += part
            return grad

        return finish


@dataclass
class _InFlight:
    out: torch.Tensor
    wait: object
    route: _Route
    row_shape: tuple
    grad: object = None  # backward: the function that receives the producer's gradient


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seam, n, box):
        ctx.seam, ctx.box, ctx.like = seam, box, x.detach()[:0]
        box.append(seam.post_forward(x.detach(), n))
        return x.new_empty(0)  # a token: orders wait after start in the graph

    @staticmethod
    def backward(ctx, _token):
        f = ctx.box[0]
        grad = f.grad() if f.grad is not None else None
        ctx.box.clear()
        if grad is None:  # a rank that produced no rows: its input was a placeholder
            grad = ctx.like.new_zeros((0,) + f.row_shape)
        return grad, None, None, None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, token, seam, box):
        ctx.seam, ctx.box = seam, box
        box[0].wait()
        return box[0].out

    @staticmethod
    def backward(ctx, g):
        f = ctx.box[0]
        # Post the gradient sends (and this rank's receives) and return: the consumer's backward
        # between start and wait runs while they travel; start's backward collects.
        f.grad = ctx.seam.post_backward(g, f.route, f.row_shape, f.out)
        return g.new_zeros(0), None, None


class Pending:
    """What `start` returns: pass it to `wait`."""

    def __init__(self, seam: Seam, token: torch.Tensor, box: list):
        self.seam, self.token, self.box = seam, token, box


def start(seam: Seam, x: torch.Tensor, n: int) -> Pending:
    """Post the forward transfers of this rank's producer rows `x` [rows, *row_shape] (a
    placeholder from `placeholder` on a rank that produces none) for `n` rows in all."""
    box: list = []
    return Pending(seam, _Start.apply(x, seam, n, box), box)


def wait(p: Pending) -> torch.Tensor:
    """This rank's consumer rows [slice, *row_shape] (empty on a rank that consumes none);
    differentiable: its gradient goes back to the producers."""
    return _Wait.apply(p.token, p.seam, p.box)


def reslice(seam: Seam, x: torch.Tensor, n: int) -> torch.Tensor:
    """start + wait with nothing between."""
    return wait(start(seam, x, n))


def placeholder(row_shape, dtype=torch.float32, device=None) -> torch.Tensor:
    """The input of a rank that produces no rows: empty, but requiring grad, so the seam's
    backward (which returns this consumer's gradients) is part of its graph."""
    return torch.empty((0, *row_shape), dtype=dtype, device=device, requires_grad=True)


def drive(y: torch.Tensor) -> None:
    """Run the backward of a rank that produced rows but consumes none (its output is empty
    and no loss depends on it): receives the gradients and backpropagates them into the producer."""
    torch.autograd.backward([y], [torch.zeros_like(y)])


def producer_grad_divisor(seam: Seam, consumer_averages: bool = True) -> int:
    """What the producer's dp-summed gradients must be divided by to match the consumer's loss:
    its dp degree when the consumer averages over dp (each rank's loss a mean), else 1."""
    return seam.consumer.dims.dp if consumer_averages else 1


def reduce_producer_grads(params, seam: Seam, consumer_averages: bool = True) -> None:
    """Sum the producer's parameter gradients over its own dp group (which is not the
    consumer's) and scale them to the consumer's loss convention."""
    if not seam.producer.member:
        return
    group, div = seam.producer["dp"], producer_grad_divisor(seam, consumer_averages)
    grads = []
    for p in params:
        if p.grad is None:  # a rank that encoded no rows still joins the reduction
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    if not grads:
        return
    # one flat all-reduce, not one per parameter: each blocking call pays the peers' wait
    flat = torch.cat([g.reshape(-1) for g in grads])
    if group.size > 1:
        C.all_reduce(flat, group)
    if div != 1:
        flat.div_(div)
    for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(piece.view_as(g))


__all__ = ["Pending", "Seam", "drive", "placeholder", "reduce_producer_grads", "reslice", "start", "wait"]
