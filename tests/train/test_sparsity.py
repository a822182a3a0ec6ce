"""Dynamic sparse training in the trainer: masks on the parallel model agree with the
single-device computation, RigL resets regrown weights' optimizer state, resume is exact.

Mask agreement is checked three ways: the masks gathered from the tp shards (and from every
dp rank) are identical; they equal the mask the core computes on the gathered full weight;
and a tp-2 sparse run's float32 losses equal the single-process sparse run's, which could
not hold if any rank multiplied by a different mask.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from meshspeed import comm
from meshspeed.checkpoint.dcp import CheckpointError
from meshspeed.comm import ConfigError
from meshspeed.comm.placement import full_tensor
from meshspeed.parallel.optim import build_data_parallel
from meshspeed.plan import config
from meshspeed.sparse import is_nm, is_transposable_nm, mask_for
from meshspeed.sparse.view import gather_mask
from meshspeed.train.trainer import Trainer
from tests import harness

BASE = [
    ("model.n_heads", "4"),
    ("model.n_kv_heads", "4"),
    ("train.seq_len", "32"),
    ("train.global_batch_size", "8"),
    ("train.micro_batch_size", "2"),
    ("train.dtype", "float32"),
    ("train.eval_interval", "0"),
    ("train.warmup_steps", "3"),
    ("data.max_mb", "1"),
]
NM24 = [("sparsity.pattern", "2:4"), ("sparsity.update_interval", "3")]
RIGL = [
    ("sparsity.pattern", "unstructured"),
    ("sparsity.target", "0.5"),
    ("sparsity.method", "rigl"),
    ("sparsity.update_interval", "2"),
]


def _cfg(run_dir: str, extra: list) -> config.Config:
    return config.load(None, BASE + [("run.dir", run_dir)] + extra)


def _full_masks(trainer) -> dict[str, torch.Tensor]:
    """Every sparse weight's mask gathered from the local buffers (collective over tp)."""
    return {v.name: gather_mask(v.local.mask, v.split_groups, v.sharding) for v in trainer.sparsity.views}


def _full_weights(trainer) -> dict[str, torch.Tensor]:
    return {
        v.name: full_tensor(v.local.weight, v.split_groups, v.sharding).float()
        for v in trainer.sparsity.views
    }


def job_sparse_run(ctx, run_dir: str, extra: list, steps: int):
    """Losses of `steps` steps; then, right after the last update, the gathered masks and
    whether each equals the core's mask of the gathered full weight."""
    trainer = Trainer(_cfg(run_dir, extra + [("train.steps", str(steps))]), ctx)
    rows, recomputed = [], {}
    for s in range(steps):
        rows.append(trainer.train_step(s))
        if "flip_rate" not in rows[-1]:
            continue
        masks, weights = _full_masks(trainer), _full_weights(trainer)
        for v in trainer.sparsity.views:
            if v.nm is not None:  # right after an update, an N:M mask is a function of the weight
                ok = torch.equal(mask_for(_Probe(v, weights[v.name]), 1.0), masks[v.name])
                recomputed[f"{s}:{v.name}"] = ok
    return [r["loss"] for r in rows], rows, _full_masks(trainer), recomputed


class _Probe:
    """A full weight with a target's pattern, for mask_for."""

    def __init__(self, view, weight):
        self.weight, self.name, self.nm, self.transposable, self.groups = (
            weight,
            view.name,
            view.nm,
            view.transposable,
            view.groups,
        )


_REF: dict = {}


def _reference(tmp_path_factory, key: str, extra: list, steps: int):
    if key not in _REF:
        _REF[key] = harness.run(
            1,
            job_sparse_run,
            str(tmp_path_factory.mktemp(f"ref-{key}")),
            extra + [("parallel.tp", "1")],
            steps,
        )[0]
    return _REF[key]


# Six steps: the initial masks (from the layout-independent init, so bitwise equal) and one or two
# updates. Later, a mask entry at a near-tie may legitimately flip between layouts, because their
# float32 weights differ in the last bits; the in-job check (sharded mask == mask of the gathered
# full weight, at every update) is what proves agreement then.
CASES = [
    ("tiny-2:4", [("model.preset", "tiny")] + NM24, 6),
    ("tiny-rigl", [("model.preset", "tiny")] + RIGL, 6),
    (
        "moe-2:4-srste",
        [("model.preset", "tiny-moe"), ("model.n_kv_heads", "2"), ("sparsity.method", "sr-ste")] + NM24,
        6,
    ),
]


@pytest.mark.parametrize("key,extra,steps", CASES, ids=[c[0] for c in CASES])
def test_tp2_sparse_run_matches_single_process_and_masks_agree(tmp_path_factory, key, extra, steps):
    want_losses, want_rows, _, want_recomputed = _reference(tmp_path_factory, key, extra, steps)
    got = harness.run(
        2, job_sparse_run, str(tmp_path_factory.mktemp(key)), extra + [("parallel.tp", "2")], steps
    )
    losses, rows, masks, recomputed = got[0]
    for step, (g, w) in enumerate(zip(losses, want_losses)):
        assert abs(g - w) <= 1e-5 * abs(w), f"{key} step {step}: tp 2 loss {g} vs single-process {w}"
    for name, m in masks.items():
        assert torch.equal(m, got[1][2][name]), f"{name}: tp ranks gathered different masks"
        if "2:4" in key:
            ok = is_transposable_nm(m) if m.shape[-2] % 4 == 0 else is_nm(m, 2, 4)
            assert ok, f"{name}: mask is not 2:4"
    assert all(recomputed.values()) and all(want_recomputed.values()), (
        "sharded mask != mask of the full weight"
    )
    if key == "tiny-rigl":
        for name, m in masks.items():
            assert int(m.sum()) == m.numel() // 2, f"{name}: RigL changed the layer's density"
    assert "flip_rate" not in rows[0] and sum("flip_rate" in r for r in rows) >= 2  # done = 3, 6 or 2, 4, 6
    assert all("sparsity" in r for r in rows) and abs(rows[-1]["sparsity"] - 0.5) < 1e-3
    if "moe" in key:
        assert any(name.endswith("experts.w2") for name in masks), "expert weights were not sparsified"


def job_rigl_state(ctx, run_dir: str, extra: list, steps: int):
    """dp 2, ZeRO-1, bf16: after each step, regrown weights and their master and moments are zero,
    density is constant, the bf16 parameter equals its rounded fp32 master, masks agree over dp."""
    trainer = Trainer(_cfg(run_dir, extra + [("train.steps", str(steps))]), ctx)
    names = {
        v.name: n
        for v in trainer.sparsity.views
        for n, p in trainer.model.named_parameters()
        if p is v.local.weight
    }
    checked = 0
    for s in range(steps):
        old = _full_masks(trainer)
        row = trainer.train_step(s)
        new = _full_masks(trainer)
        state = trainer.opt.state_dict_per_param()  # collective over dp
        for v in trainer.sparsity.views:
            st, p = state[names[v.name]], v.local.weight.detach()
            assert int(new[v.name].sum()) == int(old[v.name].sum()), f"step {s} {v.name}: density changed"
            assert torch.equal(p, st["master"].to(p.dtype)), f"step {s} {v.name}: parameter != master"
            regrown = new[v.name] & ~old[v.name]
            if regrown.any():
                checked += int(regrown.sum())
                for k in ("master", "exp_avg", "exp_avg_sq"):
                    assert not st[k][regrown].any(), f"step {s} {v.name}: {k} of regrown weights not zero"
                assert not p[regrown].any()
        if "flip_rate" in row:
            assert row["flip_rate"] > 0 or s >= 5
    return checked, {k: m for k, m in _full_masks(trainer).items()}


def test_rigl_regrown_weights_start_from_zero_state_under_zero1_bf16(tmp_path):
    extra = RIGL + [("parallel.tp", "1"), ("parallel.zero", "1"), ("train.dtype", "bfloat16")]
    got = harness.run(2, job_rigl_state, str(tmp_path), extra, 7)
    assert got[0][0] > 0, "no weight was regrown: the test checked nothing"
    for name, m in got[0][1].items():
        assert torch.equal(m, got[1][1][name]), f"{name}: dp ranks hold different masks"


def job_reset_state(ctx):
    mesh = comm.ParallelDims(dp=ctx.world_size).build(ctx)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12), nn.Linear(12, 4))
    dp, opt = build_data_parallel(model, mesh, zero=1, dtype=torch.bfloat16, lr=1e-2)
    model(torch.randn(5, 8).bfloat16()).float().square().mean().backward()
    opt.step()
    where = torch.zeros(12, 8, dtype=torch.bool)
    where[::3, 1::2] = True
    before = opt.state_dict_per_param()["0.weight"]
    n = opt.reset_state_where(model[0].weight, where)
    after = opt.state_dict_per_param()
    return n, before, after["0.weight"], after["1.weight"], model[0].weight.detach().clone(), where


def test_reset_state_where_zeroes_param_master_and_moments_on_every_zero_shard():
    got = harness.run(2, job_reset_state)
    for n, before, after, _, w, where in got:
        assert n == int(where.sum())
        for k in ("master", "exp_avg", "exp_avg_sq"):
            assert not after[k][where].any() and before[k][where].any()
            assert torch.equal(after[k][~where], before[k][~where])
        assert not w[where].any() and torch.equal(w, after["master"].bfloat16())
    assert torch.equal(got[0][3]["master"], got[1][3]["master"])


def job_run(ctx, run_dir: str, extra: list):
    return Trainer(_cfg(run_dir, extra), ctx).run()["checkpoint"]


def _rows(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k != "tokens_per_s"} for line in f]


def test_resumed_sparse_run_equals_uninterrupted_run(tmp_path):
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    layout = RIGL + [
        ("parallel.tp", "2"),
        ("train.steps", "12"),
        ("sparsity.update_interval", "3"),
        ("sparsity.warmup_steps", "2"),
    ]
    harness.run(2, job_run, straight, layout)
    harness.run(2, job_run, split, layout + [("train.exit_interval", "5")])
    assert len(_rows(split)) == 5
    harness.run(2, job_run, split, layout + [("checkpoint.resume", "latest")])
    a, b = _rows(straight), _rows(split)
    assert len(a) == 12 and sum("flip_rate" in r for r in a) >= 3
    assert a == b  # bit-identical: loss, grad norm, sparsity and flip rates
    # the tp-sharded masks reshard: resume the step-5 checkpoint in one process (tp 1)
    other = str(tmp_path / "tp1")
    harness.run(
        1,
        job_run,
        other,
        layout + [("parallel.tp", "1"), ("checkpoint.resume", os.path.join(split, "step-000005"))],
    )
    c = _rows(other)
    assert [r["step"] for r in c] == list(range(5, 12))
    for x, y in zip(a[5:], c):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * x["loss"] and x["sparsity"] == y["sparsity"], (x, y)
        assert ("flip_rate" in x) == ("flip_rate" in y)


def job_build_error(ctx, run_dir: str, extra: list):
    try:
        Trainer(_cfg(run_dir, extra), ctx)
    except (ConfigError, CheckpointError) as err:
        return str(err)
    return None


def test_dense_checkpoint_into_sparse_run_names_the_missing_masks(tmp_path):
    harness.run(1, job_run, str(tmp_path), [("parallel.tp", "1"), ("train.steps", "1")])
    msg = harness.run(
        1,
        job_build_error,
        str(tmp_path),
        [("parallel.tp", "1"), ("train.steps", "2"), ("checkpoint.resume", "latest")] + NM24,
    )[0]
    assert msg is not None and "model buffer layers.0.attention.wq.mask is not in checkpoint" in msg, msg


def test_straddling_nm_groups_fail_with_clear_message(tmp_path):
    # wo's 128 input features over tp 2 leave 64 per rank: a 4:128 group would span both ranks
    got = harness.run(
        2, job_build_error, str(tmp_path), [("parallel.tp", "2"), ("sparsity.pattern", "4:128")]
    )
    msg = got[0]
    assert msg == got[1] and msg is not None
    for needle in (
        "layers.0.attention.wo",
        "in_features 128",
        "tp degree 2",
        "M=128",
        "straddle",
        "sparsity.layers",
    ):
        assert needle in msg, msg


@pytest.mark.parametrize(
    "overrides,needle",
    [
        ([("sparsity.pattern", "2:4"), ("sparsity.method", "rigl")], "sparsity.method='rigl' is not valid"),
        ([("sparsity.pattern", "3:2")], "sparsity.pattern='3:2' needs 0 < N < M"),
        ([("sparsity.pattern", "2:4"), ("sparsity.target", "0.7")], "sparsity.target=0.7 is not valid"),
        (
            [("sparsity.pattern", "unstructured"), ("sparsity.method", "prune")],
            "sparsity.method='prune' is not valid",
        ),
    ],
)
def test_bad_sparsity_settings_fail_at_load(overrides, needle):
    with pytest.raises(ConfigError) as info:
        config.load(None, overrides)
    assert needle in str(info.value) and "\n" not in str(info.value)
