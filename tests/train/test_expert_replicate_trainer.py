"""moe.replicate_hot in the trainer: float32 losses and every expert weight's gradient norm
equal plain expert parallelism's at ep 2 and 4, and the metrics row says what the copies
balanced and moved.

The gradient norms are read right before each optimizer step (after the data-parallel
reduction): a copy's gradient that never reached its owner, or reached it twice, shows there
even where AdamW's normalised update hides it from the losses. tiny-moe routes unevenly
enough at its seeded init (no balancing loss here) that every step makes copies.
"""

from __future__ import annotations

import json

import pytest

from meshspeed.parallel.expert import expert_params
from meshspeed.train.trainer import Trainer
from tests import harness
from tests.train.test_trainer import _cfg

MOE = [("model.preset", "tiny-moe"), ("parallel.tp", "1"), ("model.n_kv_heads", "2")]
NO_BALANCE = [("moe.balance", "none"), ("moe.aux_loss_coef", "0")]
STEPS = 3


def job_expert_rows(ctx, run_dir: str, extra: list, steps: int):
    """(losses, [per step: this rank's expert weights' gradient norms], metrics rows)."""
    trainer = Trainer(_cfg(run_dir, extra + [("train.steps", str(steps))]), ctx)
    expert, _ = expert_params(trainer.model)
    norms, step = [], trainer.opt.step

    def recording(*args, **kw):  # the reduced gradients, right before the update
        norms.append([float(p.grad.norm()) for p in expert])
        return step(*args, **kw)

    trainer.opt.step = recording
    rows = [trainer.train_step(s) for s in range(steps)]
    return [r["loss"] for r in rows], norms, rows


def _close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * abs(b)


@pytest.mark.parametrize("ep,pp", [(2, 1), (4, 1), (2, 2)], ids=["ep2", "ep4", "ep2-pp2"])
def test_replicate_hot_equals_plain_expert_parallelism(tmp_path, ep, pp):
    layout = MOE + NO_BALANCE + [("parallel.ep", str(ep)), ("parallel.pp", str(pp))]
    ws = ep * pp
    plain = harness.run(ws, job_expert_rows, str(tmp_path / "plain"), layout, STEPS)
    # K = 3 of 4 experts at ep 2 (each rank owns 2), K = 8 > 4 experts at ep 4 (each owns 1)
    k = "3" if ep == 2 else "8"
    hot = harness.run(ws, job_expert_rows, str(tmp_path / "hot"), layout + [("moe.replicate_hot", k)], STEPS)
    for rank, ((l0, n0, _), (l1, n1, rows)) in enumerate(zip(plain, hot)):
        assert all(_close(a, b, 1e-5) for a, b in zip(l1, l0)), f"rank {rank} losses {l1} vs plain {l0}"
        for step, (got, want) in enumerate(zip(n1, n0)):
            assert len(got) == len(want) > 0
            assert all(_close(a, b, 1e-5) for a, b in zip(got, want)), (
                f"rank {rank} step {step}: {got} vs {want}"
            )
        for r in rows:  # copies were made each step
            assert r["moe_copy_bytes"] > 0 and r["moe_rows_kept"] > 0, r
            assert r["moe_rows_max_mean_after"] >= 1.0 and r["moe_rows_max_mean_before"] >= 1.0, r
        # and they balanced the expert ranks (each forward's plan lowers its peak; a step's sums
        # over micro-batches need not, so not every step is required to show it)
        assert any(r["moe_rows_max_mean_after"] < r["moe_rows_max_mean_before"] for r in rows), rows
    assert all(_same_metrics(h[2], hot[0][2]) for h in hot)


def _same_metrics(a: list, b: list) -> bool:
    """Every rank reports the same copies (the plan is the same everywhere)."""
    keys = ("moe_copy_bytes", "moe_rows_kept", "moe_rows_max_mean_before", "moe_rows_max_mean_after")
    return all(x[k] == y[k] for x, y in zip(a, b) for k in keys)


def test_dry_run_memory_counts_the_copies(tmp_path, capsys, monkeypatch):
    """The per-rank estimate holds, per MoE layer, the weights of at most one copy of each hot
    expert the rank does not own (kept for backward), and one layer's copies' gradients in
    backward; nothing is spawned."""
    from meshspeed import cli
    from meshspeed.comm import launch
    from meshspeed.models import get_preset

    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("a worker was spawned"))
    args = ["train", "--model.preset", "tiny-moe", "--nproc", "4", "--parallel.tp", "1", "--parallel.ep", "4"]
    args += ["--run.dir", str(tmp_path / "r"), "--dry-run", "--json"]
    mem = {}
    for k in (0, 2, 9):
        assert cli.main([*args, "--moe.replicate_hot", str(k)]) == 0
        mem[k] = [r["memory"] for r in json.loads(capsys.readouterr().out)["ranks"]]
    c = get_preset("tiny-moe")
    expert = 3 * c.dim * c.moe_ffn_dim * 4  # float32
    layers = sum(c.is_moe_layer(i) for i in range(c.n_layers))
    for k, copies in ((2, 2), (9, 3)):  # at most the 3 experts a rank does not own
        for with_k, plain in zip(mem[k], mem[0]):
            assert with_k["activations"] - plain["activations"] == layers * copies * expert
            assert with_k["buffers"] - plain["buffers"] == copies * expert
