"""sparsify / unsparsify by FQN pattern, and per-expert masks on stacked [E, out, in] weights."""

import re

import pytest
import torch
from torch import nn

from meshspeed.sparse import (
    MaskController,
    SparseLinear,
    SparsityConfig,
    is_nm,
    is_transposable_nm,
    report,
    sparsify,
    sparsify_params,
    targets,
    unsparsify,
)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(16, 16)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    def forward(self, x):
        return x + self.mlp(self.attn(x))


class Experts(nn.Module):
    """Stacked expert weights used directly in a batched matmul, as MoE code does."""

    def __init__(self, n=3, dim=8, hidden=16):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n, hidden, dim) * 0.3)  # [E, out, in]
        self.w2 = nn.Parameter(torch.randn(n, dim, hidden) * 0.3)

    def forward(self, x):  # x [E, tokens, dim]
        h = torch.relu(torch.bmm(x, self.w1.transpose(1, 2)))
        return torch.bmm(h, self.w2.transpose(1, 2))


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(Block(), Block())


def test_filters_glob_regex_predicate():
    m = _model()
    assert sparsify(m, SparsityConfig(layers="*.mlp.*")) == ["0.mlp.0", "0.mlp.2", "1.mlp.0", "1.mlp.2"]
    assert type(m[0].attn) is nn.Linear
    m = _model()
    assert sparsify(m, SparsityConfig(layers=r"re:^1\.attn$")) == ["1.attn"]
    m = _model()
    assert sparsify(m, SparsityConfig(), filter=re.compile(r"mlp\.2$")) == ["0.mlp.2", "1.mlp.2"]
    m = _model()
    assert sparsify(m, SparsityConfig(), filter=lambda name, mod: mod.out_features == 32) == [
        "0.mlp.0",
        "1.mlp.0",
    ]


def test_sparsify_keeps_parameters_and_names():
    m = _model()
    before = dict(m.named_parameters())
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sparsify(m, SparsityConfig())
    after = dict(m.named_parameters())
    assert before.keys() == after.keys()
    assert all(before[k] is after[k] for k in before)  # optimizer still holds the live Parameters
    assert opt.param_groups[0]["params"][0] is m[0].attn.weight
    assert isinstance(m[0].attn, SparseLinear) and m[0].attn.name == "0.attn"
    assert {k for k in m.state_dict() if k.endswith("mask")} == {
        f"{b}.{sub}.mask" for b in "01" for sub in ("attn", "mlp.0", "mlp.2")
    }


def test_sparsify_rejects_bad_input_dim_naming_layer():
    m = nn.Sequential(nn.Linear(10, 8))
    with pytest.raises(
        ValueError, match=r"^0 of shape \(8, 10\): last \(input\) dim 10 is not a multiple of M=4"
    ):
        sparsify(m, SparsityConfig(pattern="2:4", transposable=False))


@pytest.mark.parametrize("pattern", ["2:4", "unstructured"])
def test_roundtrip_preserves_outputs(pattern):
    m = _model()
    dense_weights = {k: v.detach().clone() for k, v in m.state_dict().items()}
    sparsify(m, SparsityConfig(pattern=pattern, target=0.5))
    x = torch.randn(3, 16)
    y_sparse = m(x)
    unsparsify(m)
    assert not targets(m) and all(type(mod) is not SparseLinear for mod in m.modules())
    assert set(m.state_dict()) == set(dense_weights)
    torch.testing.assert_close(m(x), y_sparse)
    # bake=False gives the dense (unmasked) weights back
    m2 = _model()
    y_dense = m2(x)
    sparsify(m2, SparsityConfig(pattern=pattern, target=0.5))
    assert not torch.allclose(m2(x), y_dense)
    unsparsify(m2, bake=False)
    torch.testing.assert_close(m2(x), y_dense)


def test_per_expert_nm_masks_and_ste():
    torch.manual_seed(0)
    model = nn.Sequential(Experts())
    names = sparsify_params(
        model, SparsityConfig(pattern="2:4", transposable=False, sr_ste_lambda=0.1), "*.w1"
    )
    assert names == ["0.w1"]
    exp = model[0]
    assert "w1" in dict(exp.named_parameters()) and "w1_mask" in dict(exp.named_buffers())
    mask = exp.w1_mask
    assert mask.shape == exp.w1.shape
    assert all(is_nm(mask[e], 2, 4) for e in range(3))
    assert not torch.equal(mask[0], mask[1])  # each expert has its own mask
    x = torch.randn(3, 5, 8)
    y = model(x)
    w1m = (exp.w1.detach() * mask).requires_grad_()
    w2 = exp.w2.detach().clone().requires_grad_()
    y_ref = torch.bmm(torch.relu(torch.bmm(x, w1m.transpose(1, 2))), w2.transpose(1, 2))
    torch.testing.assert_close(y, y_ref)
    y.square().sum().backward()
    y_ref.square().sum().backward()
    torch.testing.assert_close(exp.w1.grad, w1m.grad + 0.1 * (~mask) * exp.w1.detach())
    torch.testing.assert_close(exp.w2.grad, w2.grad)
    assert isinstance(exp.w1, nn.Parameter)  # outside forward the attribute is the Parameter again


def test_per_expert_transposable_and_unstructured_budgets():
    torch.manual_seed(1)
    model = nn.Sequential(Experts(n=4, dim=8, hidden=16))
    sparsify_params(model, SparsityConfig(pattern="2:4"), "*.w*")
    assert all(
        is_transposable_nm(model[0].w1_mask[e]) and is_transposable_nm(model[0].w2_mask[e]) for e in range(4)
    )
    model = nn.Sequential(Experts(n=4))
    with torch.no_grad():
        model[0].w1[0].mul_(100)  # a loud expert must not take the others' budget
    sparsify_params(model, SparsityConfig(pattern="unstructured", target=0.75), "*.w1")
    assert model[0].w1_mask.reshape(4, -1).sum(1).tolist() == [32, 32, 32, 32]


def test_controller_drives_expert_masks_and_unsparsify_removes_them():
    torch.manual_seed(2)
    model = nn.Sequential(Experts(), nn.Linear(8, 8))
    cfg = SparsityConfig(pattern="unstructured", target=0.5, method="rigl", update_interval=1)
    sparsify(model, cfg)
    sparsify_params(model, cfg, "*.w1")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ctl = MaskController(model, opt, cfg)
    assert [n for n, _ in ctl.targets] == ["0.w1", "1"]
    counts = model[0].w1_mask.reshape(3, -1).sum(1).tolist()
    for step in (1, 2):
        model[1](model[0](torch.randn(3, 4, 8))).square().sum().backward()
        opt.step()
        rec = ctl.step(step)
        opt.zero_grad()
        assert model[0].w1_mask.reshape(3, -1).sum(1).tolist() == counts
    assert rec.layers["0.w1"].flips > 0
    assert "0.w1" in report(model)
    baked = model[0].w1.detach() * model[0].w1_mask
    unsparsify(model)
    assert "w1_mask" not in dict(model[0].named_buffers()) and not model[0]._forward_pre_hooks
    torch.testing.assert_close(model[0].w1.detach(), baked)
