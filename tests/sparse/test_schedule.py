"""Global schedule and config validation."""

import math

import pytest

from meshspeed.sparse import SparsityConfig, SparsitySchedule, cosine_anneal


def test_cubic_follows_formula_and_reaches_target():
    s_i, s_f, t0, n = 0.1, 0.8, 10, 100
    sched = SparsitySchedule(target=s_f, kind="cubic", initial=s_i, warmup_steps=t0, ramp_steps=n)
    for t in (10, 11, 35, 60, 99):
        assert sched(t) == pytest.approx(s_f + (s_i - s_f) * (1 - (t - t0) / n) ** 3)
    assert sched(0) == 0.0 and sched(9) == 0.0  # warmup is dense
    assert abs(sched(t0 + n) - s_f) <= 0.01 * s_f
    assert abs(sched(t0 + n - 1) - s_f) <= 0.01 * s_f
    values = [sched(t) for t in range(t0, t0 + n + 5)]
    assert all(a <= b + 1e-12 for a, b in zip(values, values[1:]))  # monotone ramp


def test_cosine_and_constant():
    sched = SparsitySchedule(target=0.5, kind="cosine", initial=0.0, ramp_steps=10)
    assert sched(0) == pytest.approx(0.0)
    assert sched(5) == pytest.approx(0.25)
    assert sched(10) == pytest.approx(0.5)
    const = SparsitySchedule(target=0.5, kind="constant", warmup_steps=3)
    assert [const(t) for t in range(5)] == [0, 0, 0, 0.5, 0.5]


def test_dense_finish_phase():
    cfg = SparsityConfig(
        pattern="unstructured",
        target=0.9,
        schedule="cubic",
        ramp_steps=50,
        warmup_steps=5,
        total_steps=200,
        dense_finish_steps=20,
    )
    sched = SparsitySchedule.from_config(cfg)
    assert sched.phase(0) == "warmup" and sched.phase(20) == "ramp" and sched.phase(100) == "sparse"
    assert sched(179) == pytest.approx(0.9) and sched(180) == 0.0 and sched.phase(199) == "dense-finish"
    assert "dense-finish" in sched.table([0, 100, 190])


def test_drop_fraction_cosine_anneal():
    assert cosine_anneal(0.3, 0, 0, 100) == pytest.approx(0.3)
    assert cosine_anneal(0.3, 50, 0, 100) == pytest.approx(0.15)
    assert cosine_anneal(0.3, 100, 0, 100) == pytest.approx(0.0)
    assert cosine_anneal(0.3, 25, 0, 100) == pytest.approx(0.15 * (1 + math.cos(math.pi / 4)))
    assert cosine_anneal(0.3, 500, 0, None) == 0.3


def test_config_defaults():
    assert SparsityConfig().target == 0.5 and SparsityConfig().nm == (2, 4)
    assert SparsityConfig(pattern="1:4").target == 0.75
    assert SparsityConfig(pattern="unstructured").target == 0.9
    assert SparsityConfig(method="sr-ste").sr_ste_lambda == 2e-4
    assert SparsityConfig(method="magnitude").sr_ste_lambda == 0.0
    assert SparsityConfig(pattern="4:8").use_transposable is False


@pytest.mark.parametrize(
    "kw,needle",
    [
        (dict(pattern="3:2"), "sparsity.pattern='3:2'"),
        (dict(pattern="dense"), "sparsity.pattern='dense'"),
        (dict(pattern="2:4", target=0.6), "sparsity.target=0.6"),
        (dict(schedule="linear"), "sparsity.schedule='linear'"),
        (dict(method="rigl"), "sparsity.method='rigl'"),
        (dict(pattern="unstructured", method="foo"), "sparsity.method='foo'"),
        (dict(distribution="erk"), "sparsity.distribution='erk'"),
        (dict(update_interval=0), "sparsity.update_interval=0"),
        (dict(dense_finish_steps=10), "sparsity.dense_finish_steps=10"),
        (dict(adapter="hessian"), "sparsity.adapter='hessian'"),
        (dict(pattern="unstructured", target=1.0), "sparsity.target=1.0"),
    ],
)
def test_config_errors_are_one_line_and_name_the_key(kw, needle):
    with pytest.raises(ValueError) as info:
        SparsityConfig(**kw)
    msg = str(info.value)
    assert needle in msg and "\n" not in msg
    assert "expected" in msg or "use" in msg
