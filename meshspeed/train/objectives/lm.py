"""Next-token objectives: language modelling (every token) and SFT (assistant tokens only)."""

from __future__ import annotations

from meshspeed.train.objectives import Batch, Objective, Scorer


class LM(Objective):
    """Mean next-token cross-entropy of the micro-batch. Every micro-batch of a pretraining
    step holds as many tokens, so the mean of the micro-batch means is the global mean."""

    name = "lm"

    def loss(self, forward, rows: Batch, batch: Batch, scorer: Scorer):
        return scorer.ce(forward, rows["labels"]), None


class SFT(Objective):
    """Cross-entropy on the labelled (assistant) tokens, averaged per token over the *global*
    batch, as TRL's SFTTrainer does: a conversation with a long answer weighs more than one
    with a short answer, and gradient accumulation 8 × 1 equals 1 × 8 exactly (micro-batches
    hold different numbers of answer tokens, so a mean of micro-batch means would not).

    The micro-batch's loss is its sum of token losses × replicas / (the global count): the
    trainer's mean over micro-batches and ranks then gives sum / count."""

    name = "sft"
    uses_global_batch = True

    def __init__(self):
        self.global_tokens = 0

    def prepare(self, global_batch: Batch) -> None:
        self.global_tokens = int((global_batch["labels"] != -100).sum())

    def loss(self, forward, rows: Batch, batch: Batch, scorer: Scorer):
        labels = rows["labels"]
        n = label_count(rows)
        if n == 0:  # a micro-batch (or cp slice) without answer tokens adds 0, but keeps the graph
            return forward().sum() * 0.0, None
        scale = n * scorer.replicas / max(self.global_tokens, 1)
        return scorer.ce(forward, labels) * scale, None


def label_count(rows: Batch) -> int:
    """Labelled tokens in this rank's rows: `n_labels` when the trainer counted them on the
    host before moving the rows to the device (no device sync), else counted here."""
    n = rows.get("n_labels")
    return int(n) if n is not None else int((rows["labels"] != -100).sum())
