"""The TRL oracle harness end to end (slow tier: TRL's trainers take ~15-40 s on 2 cores).

Replays TRL's own runs with meshspeed's pieces: the pair / chat records of data/chat.py (made from
the same JSON lines with the same tokenizer), meshspeed.losses on the logits of the weights TRL
held at each step. The step's loss and rewards must equal what TRL logged: this ties the records'
masks, `sequence_logps` (summed) and `dpo_loss` / `sft_loss` to TRL's whole pipeline (its
tokenization, collation, truncation rules and accumulation), not only to its loss formula.
The CI tier keeps the pieces: test_chat_data.py (masks vs HF) and test_losses_trl.py (formulas).
"""

from __future__ import annotations

import math

import pytest
import torch

from meshspeed.data.chat import load_chat, load_pairs
from meshspeed.losses import dpo_loss, preference_metrics, sequence_logps, sft_loss

pytest.importorskip("trl")
pytest.importorskip("datasets")

STEPS, BATCH, ACCUM = 3, 2, 2


def _model(out, weights):
    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(out["model_dir"]).float().eval()
    model.load_state_dict(weights)
    return model, AutoTokenizer.from_pretrained(out["tokenizer_dir"])


@torch.no_grad()
def _logps(model, tokens, labels):
    return sequence_logps(model(tokens).logits, labels)


@pytest.mark.slow
def test_dpo_steps_equal_trls_dpo_trainer(tmp_path):
    from tests.post.trl_oracle import run_dpo

    out = run_dpo(str(tmp_path), steps=STEPS, batch_size=BATCH, grad_accum=ACCUM)
    assert len(out["steps"]) == STEPS and len(out["weights"]) == STEPS
    assert abs(out["steps"][0]["loss"] - math.log(2)) < 1e-6  # TRL's own step-0 identity
    ref, tok = _model(out, out["weights"][0])
    recs = load_pairs(out["data"], tok, 64)
    per_step = BATCH * ACCUM
    for k in range(STEPS):
        policy, _ = _model(out, out["weights"][k])
        rows = slice(k * per_step, (k + 1) * per_step)
        c_t, c_l = recs["chosen_tokens"][rows], recs["chosen_labels"][rows]
        r_t, r_l = recs["rejected_tokens"][rows], recs["rejected_labels"][rows]
        losses, cr, rr = dpo_loss(
            _logps(policy, c_t, c_l), _logps(policy, r_t, r_l), _logps(ref, c_t, c_l), _logps(ref, r_t, r_l)
        )
        m = preference_metrics(cr, rr)
        want = out["steps"][k]
        assert losses.mean().item() == pytest.approx(want["loss"], abs=1e-5), k
        for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
            assert m[key].item() == pytest.approx(want[key], abs=1e-5), (k, key)


@pytest.mark.slow
def test_sft_steps_equal_trls_completion_only_loss(tmp_path):
    from tests.post.trl_oracle import run_sft

    out = run_sft(str(tmp_path), steps=STEPS, batch_size=BATCH, grad_accum=ACCUM)
    _, tok = _model(out, out["weights"][0])
    recs = load_chat(out["data"], tok, 64)
    per_step = BATCH * ACCUM
    for k in range(STEPS):
        model, _ = _model(out, out["weights"][k])
        rows = slice(k * per_step, (k + 1) * per_step)
        labels = recs["labels"][rows]
        with torch.no_grad():
            loss = sft_loss(model(recs["tokens"][rows]).logits, labels, num_tokens=(labels != -100).sum())
        assert loss.item() == pytest.approx(out["steps"][k]["loss"], abs=1e-5), k
