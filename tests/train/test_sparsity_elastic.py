"""Elastic N:M (sparsity.pattern_schedule): the pattern changes at the named step (measured
sparsity 0.75 -> 0.5 for 1:4 -> 2:4) under dp 2 x tp 2 with ZeRO-1, equal to the single process;
grown weights keep the old active ones and restart from zero state; a resume across the change
equals the uninterrupted run; bad settings fail with one line.
"""

from __future__ import annotations

import pytest
import torch

from meshspeed.comm import ConfigError
from meshspeed.plan import config
from meshspeed.sparse import is_nm
from meshspeed.train.trainer import Trainer
from tests import harness
from tests.train.test_sparsity import _cfg, _full_masks, _rows, job_build_error, job_run

ELASTIC = [
    ("model.preset", "tiny"),
    ("sparsity.pattern", "1:4"),
    ("sparsity.pattern_schedule", "0:1:4,4:2:4"),
    ("sparsity.update_interval", "3"),
]


LAYOUT = ELASTIC + [("train.steps", "8"), ("parallel.zero", "1")]


def test_pattern_change_moves_sparsity_under_tp_and_zero(tmp_path):
    straight, single = str(tmp_path / "straight"), str(tmp_path / "single")
    harness.run(4, job_run, straight, LAYOUT + [("parallel.tp", "2")])
    harness.run(1, job_run, single, LAYOUT + [("parallel.tp", "1")])
    a = _rows(straight)
    # done = 4 (after step 3) the schedule names 2:4: measured sparsity moves there, not before
    assert [r["sparsity"] for r in a] == [0.75] * 3 + [0.5] * 5
    assert "flip_rate" in a[3]
    for x, y in zip(a, _rows(single)):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * y["loss"], (x, y)
        assert x["sparsity"] == y["sparsity"]


def test_resume_across_a_pattern_change_equals_the_straight_run(tmp_path):
    tp2 = LAYOUT + [("parallel.tp", "2")]
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    harness.run(4, job_run, straight, tp2)
    a = _rows(straight)
    # stop at step 3 (before the change), resume: the change happens at the same step, bit for bit
    harness.run(4, job_run, split, tp2 + [("train.exit_interval", "3")])
    assert len(_rows(split)) == 3
    harness.run(4, job_run, split, tp2 + [("checkpoint.resume", "latest")])
    assert _rows(split) == a
    # and a checkpoint taken after the change restores the 2:4 pattern in force (its masks are
    # checked against it on load, they would fail as 1:4)
    again = str(tmp_path / "again")
    harness.run(4, job_run, again, tp2 + [("train.exit_interval", "5")])
    harness.run(4, job_run, again, tp2 + [("checkpoint.resume", "latest")])
    assert _rows(again) == a


def job_growth(ctx, run_dir: str, extra: list):
    trainer = Trainer(_cfg(run_dir, extra + [("train.steps", "5")]), ctx)
    names = {
        v.name: n
        for v in trainer.sparsity.views
        for n, p in trainer.model.named_parameters()
        if p is v.local.weight
    }
    for s in range(3):
        trainer.train_step(s)
    old = _full_masks(trainer)
    trainer.train_step(3)  # done = 4: 1:4 -> 2:4
    new = _full_masks(trainer)
    state = trainer.opt.state_dict_per_param()  # collective over dp
    out = {}
    for v in trainer.sparsity.views:
        grown = new[v.name] & ~old[v.name]
        st = state[names[v.name]]
        out[v.name] = dict(
            old=old[v.name],
            new=new[v.name],
            zero_state=all(not st[k][grown].any() for k in ("master", "exp_avg", "exp_avg_sq")),
            zero_weight=not v.local.weight.detach()[grown].any(),
            grown=int(grown.sum()),
        )
    return out, trainer.sparsity.regrown


def test_growth_keeps_active_weights_and_restarts_grown_ones_from_zero(tmp_path):
    extra = ELASTIC + [("parallel.tp", "1"), ("parallel.zero", "1"), ("sparsity.transposable", "false")]
    got = harness.run(2, job_growth, str(tmp_path), extra)
    layers, regrown = got[0]
    assert regrown > 0
    for name, d in layers.items():
        assert is_nm(d["old"], 1, 4) and is_nm(d["new"], 2, 4), name
        assert not (d["old"] & ~d["new"]).any(), f"{name}: an active weight was dropped at growth"
        assert d["grown"] == d["new"].numel() // 4
        assert d["zero_state"] and d["zero_weight"], f"{name}: grown weights kept old state"
        assert torch.equal(d["new"], got[1][0][name]["new"]), f"{name}: dp ranks differ"


def test_growth_under_zero2_fails_with_one_line(tmp_path):
    msg = harness.run(
        2, job_build_error, str(tmp_path), ELASTIC + [("parallel.tp", "1"), ("parallel.zero", "2")]
    )[0]
    assert msg is not None and "\n" not in msg
    assert "sparsity.pattern_schedule='0:1:4,4:2:4'" in msg and "parallel.zero 0 or 1" in msg, msg


@pytest.mark.parametrize(
    "value,needle",
    [
        ("4:2:4", "steps increasing from 0"),
        ("0:2:4,4:1:4", "equal to sparsity.pattern='1:4'"),
        ("0:1:4,4:unstructured", "N:M patterns only"),
        ("0:1:4,4:2:4,4:1:4", "steps increasing from 0"),
        ("0:1:4,4:9:4", "0 < N < M"),
    ],
)
def test_bad_pattern_schedule_fails_at_load(value, needle):
    with pytest.raises(ConfigError) as info:
        config.load(None, [("sparsity.pattern", "1:4"), ("sparsity.pattern_schedule", value)])
    msg = str(info.value)
    assert f"sparsity.pattern_schedule={value!r} is not valid" in msg and needle in msg and "\n" not in msg


def test_step2_settings_without_a_pattern_fail_at_load():
    for key, value in (("async_masks", "true"), ("sparse_grad_comm", "true"), ("pattern_schedule", "0:2:4")):
        with pytest.raises(ConfigError) as info:
            config.load(None, [(f"sparsity.{key}", value)])
        msg = str(info.value)
        assert f"sparsity.{key}=" in msg and "set sparsity.pattern" in msg and "\n" not in msg
