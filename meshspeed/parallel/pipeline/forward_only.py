"""The pipeline runtime's forward-only passes: validation losses and per-micro-batch rows
(a frozen reference model's sequence log-probabilities), without a schedule.

Chunk-major order (all micro-batches through chunk 0, then chunk 1, ...): every rank only waits
for activations already sent, so no schedule is needed. A mixin of PipelineRuntime (runtime.py),
whose stages, communicator and loss hooks it uses.
"""

from __future__ import annotations

import contextlib

import torch

from meshspeed import comm
from meshspeed.parallel.pipeline.actions import F, holder_of
from meshspeed.parallel.tensor import loss_fn


def micro_inputs(mb, units, device) -> tuple[torch.Tensor, ...]:
    """What stage 0 runs on, on `device`: the tokens of a (tokens, targets) pair, or the
    recipe's input keys of a batch dict (PipelineUnits.inputs)."""
    xs = tuple(mb[k] for k in units.inputs) if isinstance(mb, dict) else (mb[0],)
    return tuple(x.to(device) for x in xs)


def micro_positions(mb, default: torch.Tensor) -> torch.Tensor:
    """A micro-batch's own positions when it carries them (a vlm's M-RoPE [3, micro, seq], which
    a later stage cannot derive: it never sees the tokens), else the runtime's [seq]."""
    return mb["positions"] if isinstance(mb, dict) and "positions" in mb else default


def micro_rows(mb, units) -> int:
    """Rows of a micro-batch: the first dimension of what flows between stages."""
    return (mb[units.inputs[0]] if isinstance(mb, dict) else mb[0]).shape[0]


def micro_targets(mb) -> torch.Tensor:
    return mb["labels"] if isinstance(mb, dict) else mb[1]


def held(dp):
    """ZeRO-3 (parallel/zero3.py): the stage's parameters gathered once for the whole step, not
    per block and micro-batch (the micro-batches' passes interleave; see Zero3.held)."""
    z = getattr(dp, "zero3", None)
    return z.held() if z is not None else contextlib.nullcontext()


class _Done:
    """A last stage whose forward already ran (evaluation): its body returns that output."""

    def __init__(self, out: torch.Tensor):
        self.out = out

    def body(self, h, positions) -> torch.Tensor:
        return self.out


class ForwardOnly:
    @torch.no_grad()
    def evaluate(self, micro: list, dp=None) -> torch.Tensor:
        """Sum over `micro` of the cross-entropy, forward only (float64, CPU, on every rank).
        Chunk-major order (all microbatches through chunk 0, then chunk 1, ...): every rank
        only waits for activations already sent, so no schedule is needed. `dp`: the stage
        model's DataParallel, needed under ZeRO-3 (its parameters are gathered around the pass)."""
        with held(dp):
            return self._evaluate(micro)

    @torch.no_grad()
    def forward_rows(self, micro: list, fn, width: int, dp=None) -> torch.Tensor:
        """[len(micro), width]: fn(last stage's output, micro-batch) per micro-batch, forward
        only, broadcast from the last stage to every pp rank (a frozen reference model's
        sequence log-probabilities)."""
        with held(dp):
            rows: list[torch.Tensor] = []
            self._run_forward(micro, lambda out, mb: rows.append(fn(out, mb).reshape(width)))
        out = torch.zeros(len(micro), width, dtype=torch.float64, device=self.device)
        if rows:
            out.copy_(torch.stack(rows))
        src = holder_of(self.pp * self.vpp - 1, self.pp, self.placement)[0]
        return comm.broadcast(out, self.group, src=src).cpu()

    def _evaluate(self, micro: list) -> torch.Tensor:
        self._loss_fn = loss_fn(self.stages.model, self.stages.recipe.loss) if self.stages.has_head else None
        self._losses, self._metrics = [], []

        def last(out, mb):
            self._losses.append(self._last(_Done(out), None, mb, training=False))

        self._run_forward(micro, last)
        return self._reduce_losses()

    def _run_forward(self, micro: list, last) -> None:
        dtype = self._dtype()
        self._inbox = {}
        for c, chunk in enumerate(self.stages.chunks):
            stage = self._stage(c)
            src = holder_of(stage - 1, self.pp, self.placement)[0]  # unused on the first stage
            for mb, item in enumerate(micro):
                if chunk.is_first:
                    h = chunk.embed(*micro_inputs(item, chunk.units, self.device))
                elif src == self.rank:
                    h = self._inbox.pop((F, mb, c))
                else:  # rows as the micro-batch's (flow validation: every sample at 8 timesteps)
                    shape = (micro_rows(item, chunk.units), *self.shape[1:])
                    self.comm.post_recv(("eval", mb, c), src, shape, dtype)
                    h = self.comm.take(("eval", mb, c))
                out = chunk.body(h, micro_positions(item, self.positions))
                if chunk.is_last:
                    last(out, item)
                    continue
                rank, dst_chunk = holder_of(stage + 1, self.pp, self.placement)
                if rank == self.rank:
                    self._inbox[(F, mb, dst_chunk)] = out
                else:
                    self.comm.send(out, rank)
        self.comm.drain()
