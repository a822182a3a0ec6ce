"""Post-training losses as plain functions, for `meshspeed.parallelize` users' own loops.

Pure torch on whole tensors: nothing here knows about meshes or ranks, so each function is the
same on one device and on a shard of the batch (the caller reduces across ranks as it reduces
any other loss). The definitions are TRL 1.x's (`DPOTrainer`, `SFTTrainer`), checked against it
by tests/post/test_losses_trl.py.

Conventions shared with `meshspeed.data.chat`'s records:

* `labels` are aligned with `logits`: `labels[b, i]` is the token that position i predicts (the
  records already hold `labels[i] = tokens[i + 1]`), `ignore_index` (-100) where no loss is taken
  (prompt, user turns, padding). No shift happens here.
* A sequence's log-probability is the **sum** over its labelled tokens (TRL's DPO), not the
  mean: DPO's implicit reward is a log-ratio of whole-completion probabilities.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")


def token_logps(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """[B, S] log-probability of each label under `logits` [B, S, V]; 0 where ignored. Computed in
    float32 whatever the logits' dtype (a bf16 log-softmax loses the small differences DPO's
    log-ratios are made of)."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree: labels must be "
            "[batch, seq] aligned with logits [batch, seq, vocab] (labels[i] = the token position i predicts)"
        )
    nll = F.cross_entropy(
        logits.float().flatten(0, -2), labels.flatten(), ignore_index=ignore_index, reduction="none"
    )
    return -nll.view(labels.shape)


def sequence_logps(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """[B] sum of the log-probabilities of each row's non-ignored labels (TRL's DPO `logps`)."""
    return token_logps(logits, labels, ignore_index).sum(dim=-1)


def sft_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    *,
    num_tokens: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Next-token cross-entropy summed over the labelled (assistant / completion) tokens and divided
    by `num_tokens`: by default this batch's labelled-token count. Pass the count over the whole
    global batch (every micro-batch of the accumulation, every data-parallel rank) to get TRL's
    `SFTTrainer` loss, a per-token mean over the global batch (its `num_items_in_batch`), which is
    what makes 8 micro-batches of 1 equal 1 of 8 when rows hold different numbers of tokens."""
    total = -token_logps(logits, labels, ignore_index).sum()
    if num_tokens is None:
        num_tokens = (labels != ignore_index).sum()
    return total / torch.as_tensor(num_tokens, device=total.device).clamp(min=1)


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(losses [B], chosen_rewards [B], rejected_rewards [B]) of TRL 1.x's DPOTrainer; the batch's
    loss is `losses.mean()`. Inputs are [B] summed log-probabilities (see `sequence_logps`).

    With Δ = (π_c − ref_c) − (π_r − ref_r):
      sigmoid  −log σ(βΔ)                                  (DPO)
      hinge    max(0, 1 − βΔ)                               (SLiC)
      ipo      (Δ' − 1/(2β))², Δ' = each log-ratio divided by its completion's token count
               (`chosen_lengths` / `rejected_lengths`, required: TRL 1.x length-normalises IPO)
      robust   (−(1−ε) log σ(βΔ) + ε log σ(−βΔ)) / (1 − 2ε), ε = `label_smoothing` (rDPO)
    Rewards are β × (policy − reference) log-ratio, detached, for every type.

    `label_smoothing` only enters `robust`: TRL 1.x ignores it for sigmoid, ipo and hinge (the
    conservative-DPO smoothing of TRL 0.x is gone), so a non-zero value there is refused rather
    than silently dropped.
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(
            f"dpo loss_type={loss_type!r} is not known; choose one of {', '.join(DPO_LOSS_TYPES)}"
        )
    if not beta > 0:
        raise ValueError(f"dpo beta={beta} must be > 0, e.g. 0.1")
    if loss_type == "robust":
        if not 0 <= label_smoothing < 0.5:
            raise ValueError(
                f"dpo label_smoothing={label_smoothing} must lie in [0, 0.5) for robust DPO, e.g. 0.1"
            )
    elif label_smoothing != 0:
        raise ValueError(
            f"dpo label_smoothing={label_smoothing} has no effect on loss_type={loss_type!r} (TRL 1.x "
            "uses it only in robust DPO); set loss_type='robust' or label_smoothing=0"
        )
    chosen_logratios = policy_chosen_logps - ref_chosen_logps
    rejected_logratios = policy_rejected_logps - ref_rejected_logps
    delta = chosen_logratios - rejected_logratios
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * delta)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * delta)
    elif loss_type == "ipo":
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError(
                "dpo loss_type='ipo' needs chosen_lengths and rejected_lengths (each completion's token "
                "count, e.g. (labels != -100).sum(-1)): TRL 1.x averages IPO's log-ratios per token"
            )
        chosen_avg = chosen_logratios / chosen_lengths.clamp(min=1)
        rejected_avg = rejected_logratios / rejected_lengths.clamp(min=1)
        losses = (chosen_avg - rejected_avg - 1 / (2 * beta)) ** 2
    else:
        eps = label_smoothing
        losses = (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
    return losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach()


def preference_metrics(
    chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor
) -> dict[str, torch.Tensor]:
    """TRL's logged means: rewards/chosen, rewards/rejected, rewards/margins and rewards/accuracies
    (the share of pairs whose chosen reward is strictly larger: 0 when the policy is the reference)."""
    return {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
    }
