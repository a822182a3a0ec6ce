"""Where a 2:4 layer's products run: the choice from injected timings (no GPU needed)."""

import dataclasses

import pytest
import torch

from meshspeed.sparse import SparseLinear, transposable_2to4_mask
from meshspeed.sparse import choice as kc
from meshspeed.sparse.cslt_ops import ReferenceCsltOps


def _t(**kw) -> kc.ProductTimes:
    base = dict(
        dense_fwd=1.0,
        sparse_fwd=1.0,
        dense_dgrad=1.0,
        sparse_dgrad=1.0,
        compress_w=0.05,
        compress_t=0.05,
        compress_both=0.06,
        masked=0.02,
    )
    return kc.ProductTimes(**{**base, **kw})


def _auto(times, **kw):
    kw = {"can_fwd": True, "can_dgrad": True, **kw}
    c = kc.choose(times, "auto", **kw)
    return c.fwd, c.dgrad


@pytest.mark.parametrize(
    "times,plan",
    [
        (_t(sparse_fwd=0.7, sparse_dgrad=0.7), (True, True)),  # both win
        (_t(sparse_fwd=1.4, sparse_dgrad=1.4), (False, False)),  # both lose: dense-masked
        (_t(sparse_fwd=0.7, sparse_dgrad=1.3), (True, False)),  # dX is the transposed shape: it can lose
        (_t(sparse_fwd=1.3, sparse_dgrad=0.7), (False, True)),
        (_t(sparse_fwd=0.99, sparse_dgrad=0.99), (False, False)),  # 2% saved, less compression: a tie
        # 1% faster per step with free compression: inside the margin, a tie stays dense
        (_t(sparse_fwd=0.98, compress_w=0.0, compress_both=0.0, masked=0.0), (False, False)),
        # dense-masked pays for W * mask too: equal products, the cheaper preparation wins
        (_t(masked=0.5), (True, True)),
    ],
)
def test_each_product_runs_where_it_is_faster(times, plan):
    assert _auto(times) == plan


def test_issue_figures_ffn_down_projection():
    """H200, 8192 tokens, bf16 (issue 26): the down projection W2 [4096, 14336] runs y = x W2^T at
    K=14336 (2:4 0.986 ms against 1.304 dense) but dX = dY W2 at K=4096 (1.529 against 1.346):
    y sparse, dX dense-masked. Compression 1.2 ms a weight would eat the forward's gain at one
    micro-batch; with the fused kernel's target (0.15 ms a weight) it pays."""
    measured = _t(dense_fwd=1.304, sparse_fwd=0.986, dense_dgrad=1.346, sparse_dgrad=1.529, masked=0.05)
    fused = dataclasses.replace(measured, compress_w=0.15, compress_t=0.15, compress_both=0.25)
    assert _auto(fused) == (True, False)
    cslt = dataclasses.replace(measured, compress_w=1.2, compress_t=1.2, compress_both=2.4)
    assert _auto(cslt) == (False, False)
    assert _auto(cslt, uses_per_step=8) == (True, False)  # 8 micro-batches share one compression


def test_what_cannot_run_sparse_stays_dense():
    fast = _t(sparse_fwd=0.5, sparse_dgrad=0.5)
    assert _auto(fast, can_dgrad=False) == (True, False)
    no_t = dataclasses.replace(fast, sparse_dgrad=None, compress_t=None, compress_both=None)
    assert _auto(no_t) == (True, False)
    assert _auto(fast, can_fwd=False) == (False, False)
    assert kc.choose(None, "sparse", can_fwd=True, can_dgrad=False).dgrad is False


def test_forced_modes_and_a_bad_mode():
    slow = _t(sparse_fwd=9.0, sparse_dgrad=9.0)
    c = kc.choose(slow, "sparse", can_fwd=True, can_dgrad=True)
    assert (c.fwd, c.dgrad, c.reason) == (True, True, "sparsity.kernels=sparse")
    c = kc.choose(_t(sparse_fwd=0.1, sparse_dgrad=0.1), "dense", can_fwd=True, can_dgrad=True)
    assert (c.fwd, c.dgrad, c.reason) == (False, False, "sparsity.kernels=dense")
    with pytest.raises(ValueError, match="sparsity.kernels='fast': choose one of auto, sparse, dense"):
        kc.choose(slow, "fast", can_fwd=True, can_dgrad=True)


def test_choice_records_as_plain_data():
    c = kc.choose(_t(sparse_fwd=0.5, sparse_dgrad=2.0), "auto", can_fwd=True, can_dgrad=True)
    d = c.as_dict()
    assert (d["y"], d["dX"], d["dW"], d["mode"]) == ("sparse", "dense", "dense", "auto")
    assert d["ms"]["sparse_fwd"] == 0.5 and "y 2:4 0.500 / dense 1.000 ms" in d["reason"]


class _Timer:
    """Injected timings by ProductTimes field; counts the measurements."""

    def __init__(self, **ms):
        self.ms = dataclasses.asdict(_t()) | ms
        self.calls = []

    def __call__(self, name, fn, device):
        fn()  # the measured callable must run (it is the real product)
        self.calls.append(name)
        return self.ms[name]


def _layer(seed=0):
    torch.manual_seed(seed)
    layer = SparseLinear(128, 64, transposable=True, dtype=torch.bfloat16)
    layer.set_mask(transposable_2to4_mask(layer.weight))
    layer.cslt_ops, layer.kernel_mode = OPS, "auto"
    return layer


OPS = ReferenceCsltOps()


def test_each_shape_is_measured_once_and_layers_report_it(monkeypatch):
    timer = _Timer(sparse_fwd=0.5, sparse_dgrad=2.0)
    monkeypatch.setattr(kc, "CHOOSER", kc.Chooser(timer))
    model = torch.nn.Sequential(_layer(0), _layer(1))
    model[0].name, model[1].name = "a", "b"
    x = torch.randn(16, 128, dtype=torch.bfloat16)
    model[0](x), model[1](x), model[0](x)
    assert sorted(timer.calls) == sorted(f.name for f in dataclasses.fields(kc.ProductTimes))  # once
    assert model[0].kernel_choice is model[1].kernel_choice and model[0].kernel_choice.alg_fwd == 3
    assert model[0].path == "sparse-2:4-fwd" and "input gradient dense-masked: auto" in model[0].path_reason
    assert model[0](torch.randn(32, 128, dtype=torch.bfloat16)) is not None  # a new token count: measured
    assert len(timer.calls) == 2 * len(dataclasses.fields(kc.ProductTimes))
    table = kc.kernel_report(model)
    assert table.splitlines()[1].split()[:4] == ["a", "sparse", "dense", "dense"]
    assert set(kc.kernel_choices(model)) == {"a", "b"}


def test_the_trainer_setting_reaches_the_layers_prints_once_and_records(monkeypatch, capsys):
    """--sparsity.kernels: validated like every choice, given to each SparseLinear by the
    trainer's hook, whose first after_step prints the choices once; kernel_choices() is what
    meta.json records. (The stand-in ops let the CPU take the CUDA path.)"""
    from meshspeed import comm
    from meshspeed.plan.config import load
    from meshspeed.train.sparsity import build_sparsity

    with pytest.raises(comm.ConfigError, match="sparsity.kernels='fast' is not valid; choose one of auto"):
        load(None, [("sparsity.kernels", "fast")])
    section = load(None, [("sparsity.pattern", "2:4"), ("sparsity.kernels", "dense")]).sparsity
    monkeypatch.setattr(kc, "CHOOSER", kc.Chooser(_Timer()))
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].w1 = torch.nn.Linear(128, 64, dtype=torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    hook = build_sparsity(section, model, opt, comm.ParallelDims().build(comm.init()), total_steps=4)
    layer = model.layers[0].w1
    assert isinstance(layer, SparseLinear) and layer.kernel_mode == "dense"
    layer.cslt_ops = OPS
    layer(torch.randn(16, 128, dtype=torch.bfloat16)).sum().backward()
    hook.after_step(0)
    hook.after_step(1)
    printed = capsys.readouterr().out
    assert printed.count("2:4 kernels") == 1 and "layers.0.w1" in printed
    record = hook.kernel_choices()["layers.0.w1"]
    assert (record["y"], record["dX"], record["reason"]) == ("dense", "dense", "sparsity.kernels=dense")
