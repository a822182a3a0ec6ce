"""Execute a pipeline schedule: this rank's action list, in order, over meshspeed.comm.

    stages = build_stages(recipe, mesh, vpp=2, seed=0)                # stage.py
    dp, opt = build_data_parallel(stages.model, mesh, ...)
    rt = PipelineRuntime(stages, mesh, "interleaved", microbatches=8, micro_batch_size=2, seq_len=128)
    loss_sum = rt.train_step(micro_batches, dp)                      # then clip, opt.step()

The schedule (schedules.py, communication placed by comms.py, checked by validate.py) is the
whole plan; the runtime adds no ordering of its own:
- F: run the chunk on the microbatch (stage 0: the recipe's inputs, tokens or a dit's x_t, t,
  y; else the received activations, made a leaf that requires grad). The last stage computes
  the loss; each microbatch's backward starts from loss / m (+ MoE aux / m), so gradients are
  those of the mean over microbatches, exactly what the plain accumulation loop produces.
- B: backward from the chunk's output, seeded by the received gradient. Split schedules
  (zero-bubble, dualpipev) take only the input gradient here (split_backward.py) and W
  accumulates the weight gradients later; every other schedule does the full backward in B,
  and so does a split schedule's B whose W comes right after it (DualPipeV's "B W").
- Overlap (`overlap=True`): the adjacent independent F/B pairs pairs.py picks run as one step,
  the forward on this thread and the backward on a helper, handing over whenever one side's
  MoE all-to-all is in flight (duet.py). Same arithmetic, so the same losses and gradients.
- SEND: isend, never waited until the step ends (reaped as they complete).
- RECV: the irecv was posted one compute earlier, so the transfer overlaps that compute (on
  gloo; see `prefetch`); the runtime waits at the spot the schedule placed the RECV.
- Data parallelism: each chunk's last parameter-gradient action (its last B, or W when split)
  runs outside dp.no_sync(), so the bucketed reduction of that chunk's gradients starts while
  the pipeline drains; all earlier ones accumulate locally.
- ZeRO-3: the stage's parameters are gathered when the step starts and freed when it ends
  (Zero3.held), not per micro-batch.

The loss is computed on the last stage, summed over microbatches and broadcast over the pp
group, so every rank reports the same number.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from meshspeed import comm
from meshspeed.parallel.pipeline.actions import (
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    ScheduleError,
    W,
    holder_of,
    stage_of,
)
from meshspeed.parallel.pipeline.duet import Duet
from meshspeed.parallel.pipeline.forward_only import (
    ForwardOnly,
    held,
    micro_inputs,
    micro_positions,
    micro_targets,
)
from meshspeed.parallel.pipeline.pairs import overlapped
from meshspeed.parallel.pipeline.schedules import build_schedule, get_schedule
from meshspeed.parallel.pipeline.split_backward import WeightGrad, split_backward
from meshspeed.parallel.pipeline.stage import PipelineStages
from meshspeed.parallel.pipeline.stage_comm import StageComm
from meshspeed.parallel.pipeline.validate import validate
from meshspeed.parallel.tensor import loss_fn


@dataclass
class _Live:
    """One (microbatch, chunk) between its F and its last backward piece."""

    leaf: torch.Tensor | None  # the stage input (requires grad); None on the first stage
    roots: list[torch.Tensor]  # backward starts here: output or loss / m, then aux / m
    emb: torch.Tensor | None = None  # split, first stage: embedding output, its backward is W's
    wgrad: WeightGrad | None = None


class PipelineRuntime(ForwardOnly):
    def __init__(
        self,
        stages: PipelineStages,
        mesh,
        schedule: str = "1f1b",
        microbatches: int = 1,
        *,
        micro_batch_size: int,
        seq_len: int,
        sequence_parallel: bool = False,
        trace: bool = False,
        prefetch: bool | None = None,
        positions: torch.Tensor | None = None,
        overlap: bool = False,
    ):
        """positions: the token positions this rank's micro-batches hold (context parallelism
        gives each cp rank a slice of every sequence); default 0..seq_len-1. overlap: run the
        schedule's overlappable F/B pairs as one step each (pairs.py, duet.py)."""
        self.stages, self.mesh = stages, mesh
        self.pp, self.vpp, self.rank = stages.pp, stages.vpp, stages.rank
        self.name, self.microbatches = schedule, microbatches
        fn = get_schedule(schedule)
        self.split, self.placement = fn.split_backward, fn.placement
        if self.pp > 1 and stages.placement != self.placement:
            raise ScheduleError(
                f"schedule {schedule!r} places stages {self.placement!r} but the stages were cut for "
                f"{stages.placement!r}; build them with placement=get_schedule({schedule!r}).placement"
            )
        self.schedule = build_schedule(schedule, self.pp, self.vpp, microbatches)
        validate(self.schedule, self.pp, self.vpp, microbatches, split=self.split, placement=self.placement)
        starts: list[list[int]] = [[] for _ in range(self.pp)]
        if overlap:
            self.schedule, starts = overlapped(self.schedule, self.pp, self.vpp, self.placement, self.split)
        self.actions = self.schedule[self.rank]
        self._pairs = {i: self._partner(i) for i in starts[self.rank]}  # F index -> its B's index
        self.last_duets: list[Duet] = []  # the last step's overlapped pairs (hand-overs, busy time)
        self.group = mesh["pp"]
        self.device = torch.device(mesh.ctx.device)
        tp = mesh["tp"].size
        if positions is not None:
            seq_len = len(positions)  # the rank's slice: what flows between stages
        if sequence_parallel and seq_len % tp:
            raise comm.ConfigError(
                f"sequence parallelism needs train.seq_len={seq_len} divisible by parallel.tp={tp}"
            )
        # [micro, carry + seq(/tp), dim]: every message between stages has this shape (carry:
        # rows a family packs ahead of the sequence, a dit's conditioning; PipelineUnits)
        self.shape = (
            micro_batch_size,
            stages.recipe.pipeline.carry + (seq_len // tp if sequence_parallel else seq_len),
            stages.recipe.hidden_size,
        )
        self.positions = (
            torch.arange(seq_len, device=self.device) if positions is None else positions.to(self.device)
        )
        # Posting receives early is safe on gloo, where each transfer progresses on its own.
        # On stream-ordered transports (NCCL, HCCL) an early receive queues ahead of sends to
        # the same peer, so there it is posted at its spot.
        self.prefetch = (mesh.ctx.backend == "gloo") if prefetch is None else prefetch
        self.comm = StageComm(self.group, self.device)
        # A split B whose own W is the next compute runs the whole backward; that W does nothing.
        self._fused: dict[int, int] = {}  # B index -> its W's index
        for i, a in enumerate(self.actions):
            if a.kind == B and self.split:
                j = self._partner(i)
                if j is not None and self.actions[j] == Action(W, a.microbatch, a.chunk):
                    self._fused[i] = j
        # Each chunk's last weight-gradient action runs with the dp reduction on (W, or a B
        # that runs the whole backward).
        producers = [
            (a.chunk, i)
            for i, a in enumerate(self.actions)
            if (a.kind == W and i not in self._fused.values())
            or (a.kind == B and (not self.split or i in self._fused))
        ]
        self._sync_at = {max(i for c, i in producers if c == chunk) for chunk in {c for c, _ in producers}}
        self._post_before: dict[int, list[int]] = defaultdict(list)
        last_compute = 0
        for i, a in enumerate(self.actions):
            if a.is_compute:
                last_compute = i
            elif a.kind in (RECV_F, RECV_B):
                self._post_before[last_compute if self.prefetch else i].append(i)
        self.trace = trace
        self.last_trace: list[tuple[float, float]] | None = None  # (start, end) per action, seconds
        # How the last stage's training forward becomes its loss: last_loss(forward, targets),
        # forward() running the chunk's body (memory.chunked_loss swaps the head out inside);
        # None: the model's cross-entropy of the logits.
        self.last_loss = None
        # A training objective instead (train/objectives): objective(forward, micro-batch dict)
        # -> (loss, a vector of `n_metrics` metrics or None); the metrics are summed over
        # micro-batches and broadcast with the loss (last_metrics after a step).
        self.objective = None
        self.n_metrics = 0
        self.last_metrics: torch.Tensor | None = None

    # -- helpers ----------------------------------------------------------------------------
    def _stage(self, chunk: int) -> int:
        return stage_of(self.rank, chunk, self.pp, self.placement)

    def _partner(self, i: int) -> int | None:
        """Index of the first compute action after action i."""
        return next((j for j in range(i + 1, len(self.actions)) if self.actions[j].is_compute), None)

    def _dtype(self) -> torch.dtype:
        return next(self.stages.model.parameters()).dtype

    def _key(self, a: Action) -> tuple[str, int, int]:
        return (F if a.kind in (RECV_F, SEND_F) else B, a.microbatch, a.chunk)

    def _emit(self, kind: str, mb: int, chunk: int, tensor: torch.Tensor) -> None:
        """Hand `tensor` (activation if kind F, input gradient if B) to its consumer: kept for
        the SEND action, or stored locally when the neighbouring stage is on this rank."""
        stage = self._stage(chunk) + (1 if kind == F else -1)
        rank, dst_chunk = holder_of(stage, self.pp, self.placement)
        if rank == self.rank:
            self._inbox[(kind, mb, dst_chunk)] = tensor.detach()
        else:
            self._outbox[(kind, mb, chunk)] = tensor

    def _take(self, kind: str, mb: int, chunk: int) -> torch.Tensor:
        return self._inbox.pop((kind, mb, chunk))

    # -- the step ---------------------------------------------------------------------------
    def train_step(self, micro: list, dp=None) -> torch.Tensor:
        """Forward and backward of every microbatch by the schedule. `micro`: (tokens, targets)
        pairs, or batch dicts with `tokens` (and what the objective reads). Returns the sum over
        microbatches of the loss (float64, CPU), the same on every rank; gradients (of the
        mean) are left in the parameters / DP buckets."""
        if len(micro) != self.microbatches:
            raise ScheduleError(
                f"pipeline runtime built for {self.microbatches} microbatches got {len(micro)}"
            )
        self._micro, self._dp = micro, dp
        self._inbox: dict = {}
        self._outbox: dict = {}
        self._live: dict[tuple[int, int], _Live] = {}
        self._losses: list[torch.Tensor] = []
        self._metrics: list[torch.Tensor] = []
        self._loss_fn = loss_fn(self.stages.model, self.stages.recipe.loss) if self.stages.has_head else None
        dtype = self._dtype()
        times = [] if self.trace else None
        if self.trace:
            comm.barrier(self.group)  # a common origin for the ranks' timelines
        t_start = time.perf_counter()
        self.last_duets = []
        with held(dp):
            i = 0
            while i < len(self.actions):
                a, t0 = self.actions[i], time.perf_counter()
                if i in self._pairs:
                    end = self._pairs[i]
                    for k in range(i, end + 1):
                        self._post(k, dtype)
                    self._pair(i, end, dp)
                    if times is not None:  # the pair's span, split by the time each side ran
                        mid = t0 + self.last_duets[-1].busy[0]
                        t1 = time.perf_counter()
                        times += [(t0 - t_start, mid - t_start)] * (end - i) + [(mid - t_start, t1 - t_start)]
                    i = end + 1
                    continue
                self._post(i, dtype)
                if a.kind in (RECV_F, RECV_B):
                    self._inbox[self._key(a)] = self.comm.take((a.kind, a.microbatch, a.chunk))
                elif a.kind in (SEND_F, SEND_B):
                    self.comm.send(self._outbox.pop(self._key(a)), a.peer)
                elif a.kind == F:
                    self._forward(a)
                elif a.kind == B or i not in self._fused.values():  # a fused W ran with its B
                    with self._sync(dp, i):
                        self._backward(a, i) if a.kind == B else self._weight(a)
                if times is not None:
                    times.append((t0 - t_start, time.perf_counter() - t_start))
                i += 1
            self.comm.drain()
        if self._live or self._inbox or self._outbox:
            raise RuntimeError(
                f"pipeline step ended with state left: live {list(self._live)[:4]}, "
                f"inbox {list(self._inbox)[:4]}, outbox {list(self._outbox)[:4]}"
            )
        self.last_trace = times
        return self._reduce_losses()

    def _post(self, i: int, dtype) -> None:
        for j in self._post_before.get(i, ()):
            r = self.actions[j]
            self.comm.post_recv((r.kind, r.microbatch, r.chunk), r.peer, self.shape, dtype)

    def _sync(self, dp, i: int):
        """dp reduction on for a chunk's last weight-gradient action, accumulation elsewhere."""
        return contextlib.nullcontext() if dp is None or i in self._sync_at else dp.no_sync()

    def _pair(self, i: int, end: int, dp) -> None:
        """F at i (then its sends) and B at `end`, as one overlapped step (duet.py)."""
        f, b = self.actions[i], self.actions[end]

        def forward() -> None:
            self._forward(f)
            for s in self.actions[i + 1 : end]:  # F's sends leave as soon as F is done
                self.comm.send(self._outbox.pop(self._key(s)), s.peer)

        duet = Duet()
        with self._sync(dp, end):
            duet.run(forward, lambda: self._backward(b, end))
        self.last_duets.append(duet)

    def _reduce_losses(self) -> torch.Tensor:
        """The loss summed over micro-batches (and the objective's metrics, into last_metrics),
        broadcast from the last stage's rank so every pp rank reports the same."""
        total = torch.zeros(1 + self.n_metrics, dtype=torch.float64, device=self.device)
        for loss in self._losses:
            total[0] += loss.double()
        for m in self._metrics:
            total[1:] += m.double()
        self._losses, self._metrics = [], []
        # from the rank holding the last stage: pp-1 ("loop"), 0 (DualPipeV's "v")
        src = holder_of(self.pp * self.vpp - 1, self.pp, self.placement)[0]
        total = comm.broadcast(total, self.group, src=src).cpu()
        self.last_metrics = total[1:] if self.n_metrics else None
        return total[0]

    def _last(self, chunk, h, mb, training: bool) -> torch.Tensor:
        """The last stage's loss of micro-batch `mb` (its metrics kept for _reduce_losses)."""
        forward = lambda: chunk.body(h, micro_positions(mb, self.positions))  # noqa: E731
        if self.objective is not None:
            loss, metrics = self.objective(forward, mb)
            if metrics is not None:
                self._metrics.append(metrics.detach())
            return loss
        y = micro_targets(mb).to(self.device)
        if training and self.last_loss is not None:
            return self.last_loss(forward, y)
        return self._loss_fn(forward(), y)

    def _forward(self, a: Action) -> None:
        chunk = self.stages.chunks[a.chunk]
        mb = self._micro[a.microbatch]
        leaf = emb = None
        if chunk.is_first:
            h = chunk.embed(*micro_inputs(mb, chunk.units, self.device))
            if self.split:  # W runs the embedding's backward (it is a weight gradient)
                emb, h = h, h.detach().requires_grad_()
                leaf = h
        else:
            h = leaf = self._take(F, a.microbatch, a.chunk).requires_grad_()
        m = self.microbatches
        if chunk.is_last:
            loss = self._last(chunk, h, mb, training=True)
            self._losses.append(loss.detach())
            roots = [loss / m]
        else:
            out = chunk.body(h, micro_positions(mb, self.positions))
            roots = [out]
            self._emit(F, a.microbatch, a.chunk, out.detach().contiguous())
        aux = chunk.aux_loss()
        if aux is not None:
            roots.append(aux / m)
        self._live[(a.microbatch, a.chunk)] = _Live(
            leaf if not chunk.is_first or self.split else None, roots, emb
        )

    def _backward(self, a: Action, i: int) -> None:
        key = (a.microbatch, a.chunk)
        chunk = self.stages.chunks[a.chunk]
        full = not self.split or i in self._fused
        live = self._live.pop(key) if full else self._live[key]
        grads = [None] * len(live.roots)
        if not chunk.is_last:
            grads[0] = self._take(B, a.microbatch, a.chunk)
        if full:
            torch.autograd.backward(live.roots, grads)
            if live.emb is not None:  # split schedule, first stage: the embedding's backward too
                torch.autograd.backward([live.emb], [live.leaf.grad])
            elif live.leaf is not None:
                self._emit(B, a.microbatch, a.chunk, live.leaf.grad)
            return
        inputs = [live.leaf] if live.leaf is not None else []
        got, live.wgrad = split_backward(live.roots, grads, inputs, chunk.parameters())
        if live.emb is not None:
            # the embedding's backward is seeded by the gradient at its output: part of W
            live.wgrad.groups.append(([live.emb], [got[0]], chunk.embedding_params()))
        elif inputs:
            self._emit(B, a.microbatch, a.chunk, got[0])
        live.roots, live.leaf = [], None  # W holds what it needs

    def _weight(self, a: Action) -> None:
        live = self._live.pop((a.microbatch, a.chunk))
        live.wgrad.run()

    def gathered_trace(self) -> list[list[tuple[float, float]]]:
        """Every pipeline rank's last_trace (collective over the pp group): times[rank][i] is
        (start, end) of self.schedule[rank][i] in seconds from the common step start."""
        if self.last_trace is None:
            raise RuntimeError("no pipeline trace recorded: build the runtime with trace=True and run a step")
        n = max(len(a) for a in self.schedule)
        mine = torch.zeros(n, 2, dtype=torch.float64)
        mine[: len(self.last_trace)] = torch.tensor(self.last_trace, dtype=torch.float64)
        every = comm.all_gather(mine.to(self.device), self.group).cpu().view(self.pp, n, 2)
        return [[tuple(every[r, i].tolist()) for i in range(len(self.schedule[r]))] for r in range(self.pp)]
