"""Load balancing as published: the auxiliary loss against Hugging Face's Mixtral function (the
convention: meshspeed's is Switch's n_experts · Σ f·P, HF's is top_k times it), the z-loss
against its formula, and DeepSeek-V3's loss-free bias balancing actually evening out a skewed
router."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from meshspeed.models import get_preset
from meshspeed.models.moe import MoE


def _layer(**over) -> MoE:
    torch.manual_seed(0)
    return MoE(dataclasses.replace(get_preset("tiny-moe"), **over))


@pytest.mark.parametrize("softmax", ["after_topk", "before_topk"])
def test_aux_loss_is_hugging_face_mixtral_over_top_k(softmax):
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    layer = _layer(router_softmax=softmax, n_experts=8, top_k=2)
    x = torch.randn(3, 10, 128)
    layer(x)
    logits = layer.router.gate(x.reshape(-1, 128)).float()
    hf = mixtral.load_balancing_loss_func((logits,), 8, 2)
    torch.testing.assert_close(layer.load_balance_loss * 2, hf, rtol=1e-6, atol=0)


def test_z_loss_is_the_mean_squared_logsumexp():
    layer = _layer()
    x = torch.randn(2, 7, 128)
    layer(x)
    logits = layer.router.gate(x.reshape(-1, 128)).float()
    want = (torch.logsumexp(logits, dim=-1) ** 2).mean()
    torch.testing.assert_close(layer.z_loss, want, rtol=1e-6, atol=0)


def test_no_bias_buffer_unless_bias_balancing():
    assert "router.bias" not in _layer().state_dict()
    assert "router.bias" in _layer(router_bias_rate=1e-3).state_dict()


def _load(counts: torch.Tensor) -> float:
    return float(counts.max() / counts.float().mean())


@torch.no_grad()
def test_bias_balancing_evens_out_a_skewed_router():
    """Expert 0's gate row points along the inputs' mean: it takes most tokens. With the bias
    updated after each 'step' (the same batch, no training) the load falls towards 1, while the
    combine weights stay the unbiased router's."""
    layer = _layer(router_bias_rate=0.02, n_experts=8, top_k=2)
    x = torch.randn(256, 128) + 1.0
    layer.router.gate.weight[0] = 0.01 * x.mean(0)  # logit ~ +1.3 for every token
    with torch.enable_grad():  # training forwards count towards the step
        layer(x)
    before = _load(layer.step_counts)
    for _ in range(150):
        counts, layer.step_counts = layer.step_counts, None
        layer.router.update_bias(counts)
        with torch.enable_grad():
            layer(x)
    after = _load(layer.step_counts)
    assert before > 2.5 and after < 1.5, (before, after)
    # the bias chose, it did not weigh: weights are the unbiased after_topk softmax of the chosen logits
    weights, experts, logits = layer.router(x)
    torch.testing.assert_close(weights, logits.gather(-1, experts).softmax(-1))
    assert layer.router.bias[0] < 0  # the hot expert was pushed down
