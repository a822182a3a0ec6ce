"""Training objectives: model outputs + a batch dict -> the micro-batch's loss and metrics.

The trainer's step, accumulation, clipping, checkpointing and metrics are the same for every
objective (DESIGN.md, "Families, modalities and objectives"); an objective says only

- `rows(batch)`: the sequences the model runs on, as a dict with `tokens` and `labels`
  [rows, seq] (and `doc_ids` for packed documents). A preference pair's chosen and rejected
  answers are two rows of the *same* micro-batch, so a pipeline's last stage holds both.
- `loss(forward, rows, batch, scorer)`: the micro-batch's loss, scaled so that the mean over
  the step's micro-batches and the data-parallel (× context-parallel) ranks is the global
  batch's loss, plus a vector of metrics averaged the same way (`metric_names`).
- `prepare(global_batch)`: per-step state computed from the whole global batch (SFT's count of
  loss tokens); every rank computes the same from the layout-independent batch.

`Scorer` is what the layout gives an objective: the cross-entropy of the model's output
layout (vocab-parallel under tp, chunked or fused when those are on), per-token
cross-entropy, a sum over each sequence that spans the context-parallel ranks, and the number
of loss replicas (micro-batches × dp × cp) a normalisation divides by.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from meshspeed import comm

Batch = dict[str, torch.Tensor]
OBJECTIVES = ("lm", "sft", "dpo", "flow")


class _CpSum(torch.autograd.Function):
    """Sum over the context-parallel ranks, each holding part of every sequence. The loss built
    on the sum is the same on every cp rank, and the gradient reduction *averages* over the cp
    ranks, so the backward scales by cp: the averaged gradient is then the whole sequence's."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.size = group.size
        return comm.all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.size, None


@dataclass
class Scorer:
    """What the layout gives an objective (built by the trainer for its model or stage)."""

    ce: Callable  # (forward, labels) -> mean CE over the labelled tokens (chunked/fused aware)
    token_ce: Callable  # (logits, labels) -> [rows, seq] CE, 0 where ignored (vocab-parallel aware)
    cp_group: object | None = None  # context parallelism: sequences are split over this group
    replicas: int = 1  # micro-batches on this rank × dp × cp: the losses a step averages

    def seq_sum(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, seq] -> [rows]: the sum over each whole sequence (every cp rank's slice)."""
        s = x.sum(-1)
        return s if self.cp_group is None or self.cp_group.size == 1 else _CpSum.apply(s, self.cp_group)


class Objective:
    name = "lm"
    metric_names: tuple[str, ...] = ()
    rows_per_record = 1  # rows the model runs per record (a preference pair: 2)
    needs_reference = False
    uses_global_batch = False  # prepare() reads the step's whole global batch
    # token_rows: rows() gives token sequences (`tokens`, `labels`, [`doc_ids`]) that the
    # trainer cuts for context parallelism and runs as model(tokens, ...). False: rows() gives
    # whatever the family's model takes, moved to the device as they are, and forward() runs it.
    token_rows = True
    tokens_per_row: int | None = None  # tokens/s counts this many per row (None: train.seq_len)
    training = True  # set by the trainer: False during validation
    step = 0  # set by the trainer: the optimizer step (or validation batch) being computed

    def forward(self, model, item: Batch) -> torch.Tensor:
        """token_rows=False: the model's output on the prepared micro-batch `item`."""
        raise NotImplementedError

    def rows(self, batch: Batch) -> Batch:
        return {k: batch[k] for k in ("tokens", "labels", "doc_ids") if k in batch}

    def prepare(self, global_batch: Batch) -> None:
        """Per-step state from the whole global batch (default: none)."""

    def loss(
        self, forward, rows: Batch, batch: Batch, scorer: Scorer
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError


def make_objective(cfg, model_config=None) -> Objective:
    """The objective `train.objective` names, with its settings (flow reads the model's
    classes and image tokens from `model_config`)."""
    from meshspeed.train.objectives.dpo import DPO
    from meshspeed.train.objectives.lm import LM, SFT

    name = cfg.train.objective
    if name == "lm":
        return LM()
    if name == "sft":
        if model_config is not None and model_config.family == "vlm":  # captions of images
            from meshspeed.train.vlm_run import Caption

            return Caption(model_config)
        return SFT()
    if name == "dpo":
        d = cfg.dpo
        return DPO(beta=d.beta, loss_type=d.loss, label_smoothing=d.label_smoothing, sft_weight=d.sft_weight)
    if name == "flow":
        from meshspeed.train.objectives.flow import make_flow

        return make_flow(cfg, model_config)
    raise comm.ConfigError(f"train.objective={name!r} is not one of {', '.join(OBJECTIVES)}")
