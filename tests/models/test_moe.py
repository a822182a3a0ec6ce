"""MoE: sorted-dispatch paths against a dense every-expert reference, aux losses by hand."""

import math

import pytest
import torch
import torch.nn.functional as F

from meshspeed.models import ModelConfig, MoE, build_model, get_preset, grouped_mm_available


def moe_config(**kw):
    base = dict(
        dim=16,
        n_heads=2,
        n_experts=4,
        top_k=2,
        moe_ffn_hidden=12,
        n_shared_experts=1,
        aux_loss_coef=0.01,
        z_loss_coef=0.001,
    )
    base.update(kw)
    return ModelConfig(**base)


def dense_reference(moe, x):
    """Every expert on every token, weighted by a [tokens, E] gate matrix (zero off the top-k)."""
    logits = (x @ moe.router.gate.weight.t()).float()
    k = moe.top_k
    if moe.router.softmax == "after_topk":
        top, idx = logits.topk(k, dim=-1)
        w = top.softmax(-1)
    else:
        w, idx = logits.softmax(-1).topk(k, dim=-1)
    gates = torch.zeros_like(logits).scatter(1, idx, w).to(x.dtype)  # [tokens, E]
    ex = moe.experts
    out = torch.zeros_like(x)
    for e in range(ex.w1.shape[0]):
        y = (F.silu(x @ ex.w1[e].t()) * (x @ ex.w3[e].t())) @ ex.w2[e].t()
        out = out + gates[:, e : e + 1] * y
    if moe.shared_expert is not None:
        out = out + moe.shared_expert(x)
    return out


def grads_of(module, x, out, g):
    params = [x] + [p for p in module.parameters()]
    return torch.autograd.grad(out, params, g)


@pytest.mark.parametrize("router_softmax", ["after_topk", "before_topk"])
@pytest.mark.parametrize("shared", [0, 1])
def test_loop_matches_dense_reference(router_softmax, shared):
    torch.manual_seed(0)
    moe = MoE(moe_config(router_softmax=router_softmax, n_shared_experts=shared, moe_impl="loop")).double()
    x = torch.randn(3, 7, 16, dtype=torch.float64, requires_grad=True)
    out = moe(x)
    ref = dense_reference(moe, x.reshape(-1, 16)).view(3, 7, 16)
    torch.testing.assert_close(out, ref)
    assert moe.tokens_per_expert.sum().item() == 21 * 2
    g = torch.randn_like(out)
    for a, r in zip(grads_of(moe, x, out, g), grads_of(moe, x, ref, g)):
        torch.testing.assert_close(a, r)


def test_loop_handles_an_expert_with_no_tokens():
    torch.manual_seed(1)
    moe = MoE(moe_config(moe_impl="loop", n_shared_experts=0)).double()
    with torch.no_grad():
        moe.router.gate.weight[3] = -100.0  # never chosen...
    x = torch.randn(8, 16, dtype=torch.float64).abs()  # ...for positive inputs
    out = moe(x)
    assert moe.tokens_per_expert[3].item() == 0
    torch.testing.assert_close(out, dense_reference(moe, x))


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")
def test_grouped_mm_matches_loop_on_cpu():
    torch.manual_seed(2)
    loop = MoE(moe_config(moe_impl="loop"))
    try:
        torch._grouped_mm(torch.ones(2, 8), torch.ones(1, 8, 8), offs=torch.tensor([2], dtype=torch.int32))
    except RuntimeError as err:
        pytest.skip(f"torch._grouped_mm does not run on CPU in this torch: {err}")
    grouped = MoE(moe_config(moe_impl="grouped_mm"))
    grouped.load_state_dict(loop.state_dict())
    x = torch.randn(2, 9, 16, requires_grad=True)
    a, b = loop(x), grouped(x)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(a)
    for ga, gb in zip(grads_of(loop, x, a, g), grads_of(grouped, x, b, g)):
        torch.testing.assert_close(ga, gb, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
def test_auto_path_on_cuda_bf16_matches_loop():
    torch.manual_seed(3)
    loop = MoE(moe_config(dim=64, moe_ffn_hidden=128, moe_impl="loop")).cuda().bfloat16()
    auto = MoE(moe_config(dim=64, moe_ffn_hidden=128, moe_impl="auto")).cuda().bfloat16()
    auto.load_state_dict(loop.state_dict())
    x = torch.randn(4, 32, 64, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(auto(x), loop(x), atol=2e-2, rtol=2e-2)


def test_aux_losses_by_hand():
    config = moe_config(
        dim=4, n_heads=1, n_experts=4, top_k=2, n_shared_experts=0, aux_loss_coef=0.5, z_loss_coef=0.25
    )
    moe = MoE(config).double()
    with torch.no_grad():
        moe.router.gate.weight.copy_(torch.eye(4))  # logits = x
    rows = [[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 0.5], [1.0, 0.0, 2.5, -0.5]]
    moe(torch.tensor(rows, dtype=torch.float64))

    n_tokens, k, n_exp = 3, 2, 4
    counts = [0] * n_exp
    mean_p = [0.0] * n_exp
    z = 0.0
    for row in rows:
        for e in sorted(range(n_exp), key=lambda e: -row[e])[:k]:
            counts[e] += 1
        total = sum(math.exp(v) for v in row)
        for e in range(n_exp):
            mean_p[e] += math.exp(row[e]) / total / n_tokens
        z += math.log(total) ** 2 / n_tokens
    lb = n_exp * sum(c / (n_tokens * k) * p for c, p in zip(counts, mean_p))

    assert counts == [2, 2, 2, 0] and moe.tokens_per_expert.tolist() == counts
    assert moe.load_balance_loss.item() == pytest.approx(lb, rel=1e-12)
    assert moe.z_loss.item() == pytest.approx(z, rel=1e-12)
    assert moe.aux_loss().item() == pytest.approx(0.5 * lb + 0.25 * z, rel=1e-12)


def test_balanced_router_gives_unit_load_balance_loss():
    moe = MoE(moe_config()).double()
    with torch.no_grad():
        moe.router.gate.weight.zero_()  # uniform probabilities
    moe(torch.randn(10, 16, dtype=torch.float64))
    assert moe.load_balance_loss.item() == pytest.approx(1.0)
    assert moe.z_loss.item() == pytest.approx(math.log(4) ** 2)


def test_aux_loss_trains_only_the_router():
    torch.manual_seed(4)
    moe = MoE(moe_config())
    moe(torch.randn(12, 16))
    moe.aux_loss().backward()
    assert moe.router.gate.weight.grad.abs().sum() > 0
    assert moe.experts.w1.grad is None and moe.shared_expert.w1.weight.grad is None


def test_model_aux_loss_and_router_stats():
    model = build_model(get_preset("tiny-moe"), seed=0)
    assert model.aux_loss().item() == 0.0  # before any forward
    model(torch.randint(0, 256, (2, 12)))
    layers = model.moe_layers()
    assert list(layers) == ["layers.0.feed_forward", "layers.1.feed_forward"]
    expected = sum(m.aux_loss_coef * m.load_balance_loss + m.z_loss_coef * m.z_loss for m in layers.values())
    aux = model.aux_loss()
    assert aux.requires_grad
    torch.testing.assert_close(aux, expected)
    stats = model.router_stats()
    assert all(s.sum().item() == 2 * 12 * 2 for s in stats.values())
    dense = build_model(get_preset("tiny"), seed=0)
    dense(torch.randint(0, 256, (1, 4)))
    assert dense.aux_loss().item() == 0.0 and dense.router_stats() == {}


def test_auto_takes_grouped_mm_on_cpu_only_where_it_runs():
    x = torch.randn(4, 16)
    assert grouped_mm_available(x, 16, 32) == hasattr(torch, "_grouped_mm")
    assert not grouped_mm_available(x, 16, 10)  # rows not 16-byte aligned: the kernel refuses
    assert not grouped_mm_available(x.double(), 16, 32)
