"""meshspeed.losses against TRL 1.x, the oracle, and the identities DPO must satisfy at step 0.

TRL's DPO loss is not a free function in 1.x: it lives inside `DPOTrainer._compute_loss`. It is
called here on a trainer object built without `__init__` whose model is a stub returning chosen
per-token log-probabilities (spread over each completion's tokens, 0 elsewhere, as TRL's fused
head returns them), with the reference log-probabilities precomputed: the same code path as a
real run (`precompute_ref_log_probs=True`), fed exactly the inputs given to `dpo_loss`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from meshspeed.losses import dpo_loss, preference_metrics, sequence_logps, sft_loss


class _Accelerator:
    device = torch.device("cpu")

    def gather(self, t):
        return t

    gather_for_metrics = gather


def trl_dpo(pc, pr, rc, rr, lc, lr, *, beta, loss_type, label_smoothing=0.0):
    """(TRL's loss, its logged metrics) for summed log-probs pc/pr (policy), rc/rr (reference) of
    completions of lc/lr tokens."""
    DPOTrainer = pytest.importorskip("trl").DPOTrainer

    b, s = pc.shape[0], int(max(lc.max(), lr.max())) + 1
    completion = torch.zeros(2 * b, s, dtype=torch.long)
    for i, n in enumerate(torch.cat([lc, lr]).tolist()):
        completion[i, 1 : 1 + n] = 1  # position 0 is the prompt
    shifted = completion[:, 1:].float()
    per_token = shifted * (torch.cat([pc, pr]) / shifted.sum(1))[:, None]

    def model(**kw):
        zeros = torch.zeros_like(per_token)
        return SimpleNamespace(log_probs=per_token, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())

    t = object.__new__(DPOTrainer)
    model.training = True
    fields = dict(
        model=model,
        accelerator=_Accelerator(),
        beta=beta,
        loss_types=[loss_type],
        loss_weights=[1.0],
        ld_alpha=None,
        f_divergence_type="reverse_kl",
        label_smoothing=label_smoothing,
        use_weighting=False,
        aux_loss_enabled=False,
        precompute_ref_logps=True,
        _metrics={"train": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    t.__dict__.update(fields)
    inputs = {
        "input_ids": torch.zeros(2 * b, s, dtype=torch.long),
        "attention_mask": torch.ones(2 * b, s, dtype=torch.long),
        "completion_mask": completion,
        "ref_chosen_logps": rc,
        "ref_rejected_logps": rr,
    }
    loss = t._compute_loss(model, inputs, return_outputs=False)
    return loss, {k: v[-1] for k, v in t._metrics["train"].items()}


def _random(b=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    logps = [-torch.rand(b, generator=g, dtype=torch.float64) * 40 for _ in range(4)]
    lengths = [torch.randint(1, 12, (b,), generator=g) for _ in range(2)]
    return logps, lengths


@pytest.mark.parametrize(
    "loss_type, beta, smoothing",
    [
        ("sigmoid", 0.1, 0.0),
        ("sigmoid", 0.5, 0.0),
        ("hinge", 0.1, 0.0),
        ("hinge", 0.05, 0.0),
        ("ipo", 0.1, 0.0),
        ("ipo", 0.5, 0.0),
        ("robust", 0.1, 0.1),
        ("robust", 0.3, 0.25),
    ],
)
def test_dpo_loss_equals_trls(loss_type, beta, smoothing):
    (pc, pr, rc, rr), (lc, lr) = _random()
    losses, cr, rrw = dpo_loss(
        pc,
        pr,
        rc,
        rr,
        beta=beta,
        loss_type=loss_type,
        label_smoothing=smoothing,
        chosen_lengths=lc,
        rejected_lengths=lr,
    )
    ref, metrics = trl_dpo(pc, pr, rc, rr, lc, lr, beta=beta, loss_type=loss_type, label_smoothing=smoothing)
    assert losses.shape == cr.shape == rrw.shape == (16,)
    torch.testing.assert_close(losses.mean(), ref.to(losses.dtype), rtol=1e-10, atol=1e-10)
    ours = {k: v.item() for k, v in preference_metrics(cr, rrw).items()}
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert ours[key] == pytest.approx(metrics[key], rel=1e-9, abs=1e-12), key


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge"])
def test_trl_ignores_label_smoothing_outside_robust_so_dpo_loss_refuses_it(loss_type):
    (pc, pr, rc, rr), (lc, lr) = _random(seed=1)
    smooth, _ = trl_dpo(pc, pr, rc, rr, lc, lr, beta=0.1, loss_type=loss_type, label_smoothing=0.2)
    plain, _ = trl_dpo(pc, pr, rc, rr, lc, lr, beta=0.1, loss_type=loss_type)
    assert smooth == plain  # TRL 1.x: no effect; a user setting it would be silently ignored
    with pytest.raises(ValueError, match=r"label_smoothing=0.2 has no effect on loss_type="):
        dpo_loss(
            pc, pr, rc, rr, loss_type=loss_type, label_smoothing=0.2, chosen_lengths=lc, rejected_lengths=lr
        )


@pytest.mark.parametrize(
    "loss_type, beta, expected",
    [
        ("sigmoid", 0.1, math.log(2)),
        ("hinge", 0.1, 1.0),
        ("ipo", 0.1, 25.0),
        ("ipo", 0.5, 1.0),
        ("robust", 0.1, math.log(2)),
    ],
)
def test_at_the_reference_the_loss_is_its_identity_and_rewards_are_zero(loss_type, beta, expected):
    """Step 0: policy = reference, so every log-ratio is 0: sigmoid ln 2, hinge 1, IPO (1/(2β))²."""
    g = torch.Generator().manual_seed(2)
    chosen, rejected = -torch.rand(8, generator=g) * 30, -torch.rand(8, generator=g) * 30
    lengths = torch.randint(1, 9, (8,), generator=g)
    losses, cr, rr = dpo_loss(
        chosen,
        rejected,
        chosen.clone(),
        rejected.clone(),
        beta=beta,
        loss_type=loss_type,
        label_smoothing=0.1 if loss_type == "robust" else 0.0,
        chosen_lengths=lengths,
        rejected_lengths=lengths,
    )
    assert abs(losses.mean().item() - expected) < 1e-6
    m = preference_metrics(cr, rr)
    assert all(
        m[k].item() == 0
        for k in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
    )


def test_sequence_logps_sums_the_labelled_tokens():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 7, 11, generator=g)
    labels = torch.randint(0, 11, (3, 7), generator=g)
    labels[0, :5] = -100  # prompt: 2 labelled tokens
    labels[1, :1] = -100  # 6 labelled tokens
    labels[2, :] = -100  # none
    logp = logits.log_softmax(-1)
    want = torch.stack(
        [
            sum((logp[b, i, labels[b, i]] for i in range(7) if labels[b, i] != -100), torch.tensor(0.0))
            for b in range(3)
        ]
    )
    torch.testing.assert_close(sequence_logps(logits, labels), want)
    # a prompt token must not change it: only labelled positions count
    other = logits.clone()
    other[0, :5] = torch.randn(5, 11, generator=g)
    assert sequence_logps(other, labels)[0] == sequence_logps(logits, labels)[0]


def test_sequence_logps_of_bf16_logits_is_computed_in_float32():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 5, 9, generator=g)
    labels = torch.randint(0, 9, (2, 5), generator=g)
    got = sequence_logps(logits.bfloat16(), labels)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, sequence_logps(logits.bfloat16().float(), labels))


def test_sft_loss_is_transformers_causal_lm_loss_per_token_over_the_global_batch():
    """TRL's SFTTrainer loss = transformers' ForCausalLMLoss with num_items_in_batch = the labelled
    tokens of the whole accumulated batch; meshspeed's labels are already shifted."""
    pytest.importorskip("transformers")
    from transformers.loss.loss_utils import ForCausalLMLoss

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 9, 13, generator=g)
    hf_labels = torch.randint(0, 13, (4, 9), generator=g)
    hf_labels[:, :3] = -100
    hf_labels[1, 6:] = -100
    ours_labels = torch.cat([hf_labels[:, 1:], torch.full((4, 1), -100)], 1)
    total = int((hf_labels[:, 1:] != -100).sum()) + 17  # other micro-batches' tokens
    want = ForCausalLMLoss(logits, hf_labels, 13, num_items_in_batch=torch.tensor(total))
    torch.testing.assert_close(sft_loss(logits, ours_labels, num_tokens=total), want)
    # alone, it is the batch's per-token mean
    torch.testing.assert_close(
        sft_loss(logits, ours_labels), F.cross_entropy(logits.flatten(0, 1), ours_labels.flatten())
    )


def test_ipo_needs_completion_lengths():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="loss_type='ipo' needs chosen_lengths and rejected_lengths"):
        dpo_loss(x, x, x, x, loss_type="ipo")
