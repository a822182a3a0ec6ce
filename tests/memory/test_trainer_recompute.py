"""`--memory.recompute` in the trainer: the losses of every mode equal the run without recompute,
under dp 2 × tp 2 (with sequence parallelism) and pp 2; the dry run's activation estimate falls
with each mode."""

from __future__ import annotations

import pytest

from meshspeed.plan import config
from meshspeed.plan.run_plan import make_plan
from tests import harness

BASE = [
    ("model.n_heads", "4"),
    ("model.n_kv_heads", "4"),
    ("train.seq_len", "32"),
    ("train.global_batch_size", "8"),
    ("train.micro_batch_size", "2"),
    ("train.dtype", "float32"),
    ("train.eval_interval", "0"),
    ("train.warmup_steps", "2"),
    ("data.max_mb", "1"),
]
LAYOUTS = {
    "dp2-tp2-sp": [("parallel.tp", "2"), ("parallel.sequence_parallel", "true")],
    "pp2": [("parallel.tp", "1"), ("parallel.pp", "2"), ("parallel.dp", "2")],
}


def job_losses(ctx, run_dir: str, extra: list, steps: int) -> list[tuple[list, list]]:
    """(losses, gradient norms) of the same layout without recompute and with each mode (one
    model each)."""
    from meshspeed.train.trainer import Trainer

    out = []
    for mode in ("none", "activation", "selective", "full"):
        over = BASE + [("run.dir", f"{run_dir}/{mode}"), ("train.steps", str(steps))] + extra
        trainer = Trainer(config.load(None, over + [("memory.recompute", mode)]), ctx)
        rows = [trainer.train_step(s) for s in range(steps)]
        out.append(([r["loss"] for r in rows], [r["grad_norm"] for r in rows]))
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_recompute_modes_train_like_the_run_without(tmp_path, name):
    got = harness.run(4, job_losses, str(tmp_path), LAYOUTS[name], 3, timeout=300)[0]
    plain, plain_norms = got[0]
    for mode, (losses, norms) in zip(("activation", "selective", "full"), got[1:]):
        # the recompute replays the same operations on the same inputs: gradients too (a
        # recomputed tensor scaled or stale would move the norm before AdamW's losses)
        assert losses == pytest.approx(plain, rel=1e-6), f"{name} {mode}: {losses} vs {plain}"
        assert norms == pytest.approx(plain_norms, rel=1e-6), f"{name} {mode}: {norms} vs {plain_norms}"
    assert plain[-1] < plain[0]


def test_dry_run_activation_estimate_falls_with_each_mode(tmp_path):
    acts = []
    for mode in ("none", "activation", "selective", "full"):
        over = BASE + [("run.dir", str(tmp_path)), ("memory.recompute", mode), ("parallel.tp", "2")]
        acts.append(make_plan(config.load(None, over), 4).ranks[0]["memory"]["activations"])
    assert acts[0] > acts[1] > acts[2] > acts[3], acts
