"""Direct preference optimisation (sigmoid, IPO, hinge), with an optional SFT term.

A record is a pair: `chosen_tokens`/`chosen_labels` and `rejected_tokens`/`rejected_labels`
[pairs, seq] (labels -100 on the prompt and padding: only completion tokens count). The model
runs both answers as rows of one micro-batch — chosen first, then rejected — so a pipeline's
last stage, a cp group or a tp group always holds both halves of a pair.

The reference log-probabilities come in the batch (`ref_chosen_logps`, `ref_rejected_logps`
[pairs]): precomputed once beside the data, or computed by the trainer's frozen reference
model (the starting weights, in the policy's layout) on the same rows just before the policy's
forward. Either way the loss reads them the same way.
"""

from __future__ import annotations

import torch

from meshspeed.losses import dpo_loss
from meshspeed.train.objectives import Batch, Objective, Scorer

REF_KEYS = ("ref_chosen_logps", "ref_rejected_logps")
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


class DPO(Objective):
    name = "dpo"
    metric_names = METRICS
    rows_per_record = 2
    needs_reference = True

    def __init__(
        self,
        beta: float = 0.1,
        loss_type: str = "sigmoid",
        label_smoothing: float = 0.0,
        sft_weight: float = 0.0,
    ):
        self.beta, self.loss_type = beta, loss_type
        self.label_smoothing, self.sft_weight = label_smoothing, sft_weight

    def rows(self, batch: Batch) -> Batch:
        return {
            "tokens": torch.cat([batch["chosen_tokens"], batch["rejected_tokens"]]),
            "labels": torch.cat([batch["chosen_labels"], batch["rejected_labels"]]),
            "n_chosen": (batch["chosen_labels"] != -100).sum(),  # whole rows: before any cp slicing
            # completion tokens per row (IPO averages its log-ratios per token, as TRL does)
            "lengths": torch.cat([(batch[k] != -100).sum(-1) for k in ("chosen_labels", "rejected_labels")]),
        }

    @staticmethod
    def sequence_logps(logits: torch.Tensor, rows: Batch, scorer: Scorer) -> torch.Tensor:
        """[rows] sum of each row's completion-token log-probabilities (all cp slices)."""
        return scorer.seq_sum(-scorer.token_ce(logits, rows["labels"]))

    def loss(self, forward, rows: Batch, batch: Batch, scorer: Scorer):
        logits = forward()
        token_logps = -scorer.token_ce(logits, rows["labels"])
        logps = scorer.seq_sum(token_logps)
        pairs = logps.shape[0] // 2
        chosen, rejected = logps[:pairs], logps[pairs:]
        ref_c, ref_r = (batch[k].to(device=logps.device, dtype=logps.dtype) for k in REF_KEYS)
        losses, r_chosen, r_rejected = dpo_loss(
            chosen,
            rejected,
            ref_c,
            ref_r,
            beta=self.beta,
            loss_type=self.loss_type,
            label_smoothing=self.label_smoothing,
            chosen_lengths=rows["lengths"][:pairs],
            rejected_lengths=rows["lengths"][pairs:],
        )
        loss = losses.mean()
        if self.sft_weight:  # NLL of the chosen answers, per token over the micro-batch (TRL's rpo_alpha)
            n = max(int(rows["n_chosen"]), 1)
            loss = loss + self.sft_weight * (-chosen.sum() / n)
        r_chosen, r_rejected = r_chosen.detach(), r_rejected.detach()
        metrics = torch.stack(
            [
                r_chosen.mean(),
                r_rejected.mean(),
                (r_chosen > r_rejected).to(r_chosen.dtype).mean(),
                (r_chosen - r_rejected).mean(),
            ]
        )
        return loss, metrics
