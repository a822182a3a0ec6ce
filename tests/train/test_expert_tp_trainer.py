"""Expert parallelism with tensor parallelism in the trainer: float32 losses and gradient norms of
the first steps equal one process's at ep 2 × tp 2 with etp = tp, etp = 1 and tp-extend-ep (with
and without sequence parallelism, with ZeRO over the expert-data-parallel group), at world 3
(tp 3, whole experts, tokens split three ways), and checkpoints saved at ep 2 × tp 2 resume in
one process.

The norms check the gradient-norm accounting (clipping reads it): expert buckets count on every
tp rank when the tp ranks hold other experts (tp-extend-ep) or other slices of an expert bucket
(etp = 1, whose edp group spans tp).
"""

from __future__ import annotations

import json
import os

import pytest

from tests import harness
from tests.train.test_expert_trainer import MOE, NO_AUX, _close
from tests.train.test_trainer import _cfg, job_run

STEPS = 5
EP2_TP2 = [("parallel.ep", "2"), ("parallel.tp", "2")]
SP = [("parallel.sequence_parallel", "true")]
_REF: dict = {}


def job_steps(ctx, run_dir: str, extra: list, steps: int):
    from meshspeed.train.trainer import Trainer

    trainer = Trainer(_cfg(run_dir, extra + [("train.steps", str(steps))]), ctx)
    rows = [trainer.train_step(s) for s in range(steps)]
    return [r["loss"] for r in rows], [r["grad_norm"] for r in rows]


def _ref(tmp_path_factory, extra=()) -> tuple[list[float], list[float]]:
    key = tuple(extra)
    if key not in _REF:
        run_dir = str(tmp_path_factory.mktemp("etp-ref"))
        _REF[key] = harness.run(1, job_steps, run_dir, MOE + list(extra), STEPS)[0]
    return _REF[key]


CASES = [
    ("etp2", EP2_TP2 + [("parallel.etp", "2")]),
    ("etp2-sp-allgather", EP2_TP2 + SP + [("moe.dispatcher", "allgather")]),
    ("etp1", EP2_TP2 + [("parallel.etp", "1")]),
    ("etp1-sp-zero2", EP2_TP2 + SP + [("parallel.etp", "1"), ("parallel.zero", "2")]),
    ("extend", EP2_TP2 + [("moe.tp_extend_ep", "true")]),
    ("extend-sp-zero1", EP2_TP2 + SP + [("moe.tp_extend_ep", "true"), ("parallel.zero", "1")]),
    ("pp2-tp2-etp1", [("parallel.pp", "2"), ("parallel.tp", "2"), ("parallel.etp", "1")]),
    ("pp2-tp2-extend-sp", [("parallel.pp", "2"), ("parallel.tp", "2"), ("moe.tp_extend_ep", "true")] + SP),
]


@pytest.mark.parametrize("extra", [c for _, c in CASES], ids=[n for n, _ in CASES])
def test_ep2_tp2_losses_equal_one_process(tmp_path, tmp_path_factory, extra):
    want_loss, want_norm = _ref(tmp_path_factory)
    for losses, norms in harness.run(4, job_steps, str(tmp_path), MOE + extra, STEPS):
        _close(losses, want_loss)
        _close(norms, want_norm)


def test_fine_grained_preset_tp_extend_ep_equals_one_process(tmp_path, tmp_path_factory):
    """16 routed experts over ep 2 × tp 2 = 4 expert ranks, 2 shared experts split over tp."""
    fine = [("model.preset", "tiny-fine-moe")]
    want_loss, want_norm = _ref(tmp_path_factory, fine)
    got = harness.run(
        4, job_steps, str(tmp_path), MOE + fine + EP2_TP2 + [("moe.tp_extend_ep", "true")], STEPS
    )
    for losses, norms in got:
        _close(losses, want_loss)
        _close(norms, want_norm)


@pytest.mark.parametrize("ep", ["1", "2"])
def test_capacity_routing_with_experts_split_over_tp_equals_one_process(tmp_path, tmp_path_factory, ep):
    """etp = tp: every tp rank routes (and drops) on all of its replica's tokens, as one process."""
    cap = [("moe.capacity_factor", "1.0")]
    want_loss, want_norm = _ref(tmp_path_factory, cap)
    dropless = _ref(tmp_path_factory)[0]
    assert any(abs(a - b) > 1e-4 * abs(b) for a, b in zip(want_loss, dropless))  # it did drop
    extra = cap + [("parallel.tp", "2"), ("parallel.ep", ep)]
    for losses, norms in harness.run(4, job_steps, str(tmp_path), MOE + extra, STEPS):
        _close(losses, want_loss)
        _close(norms, want_norm)


def test_context_parallel_tp_extend_ep_equals_one_process(tmp_path, tmp_path_factory):
    """cp 2 × tp 2, ep 2 spanning the cp ranks, folded with tp: 4 expert ranks. Router losses off,
    as in test_expert_trainer's cp test (each cp rank computes them on its slice of the sequence)."""
    want_loss, want_norm = _ref(tmp_path_factory, NO_AUX)
    extra = [("parallel.cp", "2"), ("parallel.cp_impl", "ulysses"), ("moe.tp_extend_ep", "true")]
    for losses, norms in harness.run(4, job_steps, str(tmp_path), MOE + NO_AUX + EP2_TP2 + extra, STEPS):
        _close(losses, want_loss)
        _close(norms, want_norm)


# heads divide by 3; 4 experts do not, so whole experts on each tp rank (etp 1, ep 1)
TP3 = [("model.dim", "96"), ("model.n_heads", "3"), ("model.n_kv_heads", "3")]


def test_world_3_tp3_whole_experts_equal_one_process(tmp_path, tmp_path_factory):
    want_loss, want_norm = _ref(tmp_path_factory, TP3)
    extra = TP3 + [("parallel.tp", "3"), ("parallel.etp", "1")]
    for losses, norms in harness.run(3, job_steps, str(tmp_path), MOE + extra, STEPS):
        _close(losses, want_loss)
        _close(norms, want_norm)


@pytest.mark.parametrize(
    "mode",
    [("parallel.etp", "2"), ("parallel.etp", "1"), ("moe.tp_extend_ep", "true")],
    ids=["etp2", "etp1", "extend"],
)
def test_checkpoint_at_ep2_tp2_resumes_in_one_process(tmp_path, mode):
    """Train 4 steps at ep 2 × tp 2 saving at step 2; resume in one process: steps 3-4 equal the
    uninterrupted run's (the expert shards, split over ep and tp, over ep alone, or over the
    ep × tp group, reassemble from their tags)."""
    common = MOE + [
        ("train.steps", "4"),
        ("checkpoint.interval", "2"),
        ("train.eval_interval", "0"),
        ("parallel.zero", "1"),
    ]
    full = str(tmp_path / "full")
    harness.run(4, job_run, full, common + EP2_TP2 + [mode])
    resumed = str(tmp_path / "resumed")
    harness.run(4, job_run, resumed, common + EP2_TP2 + [mode, ("train.exit_interval", "2")])
    harness.run(1, job_run, resumed, common + [("checkpoint.resume", "latest")])

    def losses(d):
        return {r["step"]: r["loss"] for r in map(json.loads, open(os.path.join(d, "metrics.jsonl")))}

    a, b = losses(full), losses(resumed)
    assert sorted(b) == [0, 1, 2, 3]
    _close([b[2], b[3]], [a[2], a[3]])


def test_dry_run_counts_each_ranks_experts_per_mode(tmp_path, capsys, monkeypatch):
    """`--dry-run --json` at ep 2 × tp 2: etp 2 and tp-extend-ep hold a quarter of every MoE
    layer's routed experts per rank, etp 1 a half (whole experts, the ep block); nothing spawned."""
    from meshspeed import cli
    from meshspeed.comm import launch
    from meshspeed.models import get_preset

    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("a worker was spawned"))
    args = ["train", "--model.preset", "tiny-moe", "--nproc", "4", "--parallel.tp", "2", "--parallel.ep", "2"]
    args += ["--run.dir", str(tmp_path / "r"), "--dry-run", "--json"]
    counts = {}
    for name, mode in (
        ("etp2", []),
        ("etp1", ["--parallel.etp", "1"]),
        ("extend", ["--moe.tp_extend_ep", "true"]),
    ):
        assert cli.main([*args, *mode]) == 0
        counts[name] = [r["params"] for r in json.loads(capsys.readouterr().out)["ranks"]]
    c = get_preset("tiny-moe")
    experts = sum(3 * c.n_experts * c.dim * c.moe_ffn_dim for i in range(c.n_layers) if c.is_moe_layer(i))
    assert counts["etp2"] == counts["extend"]
    assert counts["etp1"] == [n + experts // 4 for n in counts["etp2"]]
