"""Diffusion transformers trained by the real Trainer (train.objective=flow, issue 41): every
layout equals one process, step by step — losses, gradient norms, the stratified validation
loss, the weights after the steps and the EMA of the weights — at world sizes 2, 3 and 4 (dp
with ZeRO-1/2/3, tp + SP, dp × tp + SP, recompute); resume equals the uninterrupted run with
the EMA on; the EMA is the average of the weights each step left; the per-sample draws depend
on the sample, not on where it lands; the run plan refuses what dit does not run with.
"""

from __future__ import annotations

import pytest
import torch

from meshspeed.comm import ConfigError, placement
from meshspeed.plan import config
from meshspeed.plan.run_plan import make_plan
from meshspeed.train.objectives.flow import Flow
from meshspeed.train.trainer import Trainer
from tests import harness

STEPS = 3
BASE = [
    ("model.preset", "dit-tiny"),
    ("model.n_layers", "2"),
    ("train.objective", "flow"),
    ("train.seq_len", "16"),
    ("train.global_batch_size", "12"),
    ("train.micro_batch_size", "2"),
    ("train.dtype", "float32"),
    ("train.eval_interval", "0"),
    ("train.eval_batches", "1"),
    ("train.warmup_steps", "1"),
    ("train.lr", "1e-2"),
    ("parallel.tp", "1"),
    ("flow.label_dropout", "0.3"),  # enough drops in 36 samples to reach the null class's row
    ("flow.ema_decay", "0.5"),  # every step weighs in the average at 3 steps
]


def _cfg(run_dir: str, extra: list) -> config.Config:
    return config.load(None, BASE + [("run.dir", run_dir), ("train.steps", str(STEPS))] + extra)


def whole_weights(trainer) -> dict[str, torch.Tensor]:
    """Every parameter whole (collective over tp; ZeRO-3 gathers)."""
    with trainer._whole_weights():
        return {
            n: placement.full_tensor(p.detach(), trainer.mesh, placement.sharding_of(p)).clone()
            for n, p in trainer.model.named_parameters()
        }


def job_rows(ctx, run_dir: str, extra: list):
    """([loss, grad_norm] per step + [val loss], weights after, EMA after) — rank 0's tensors."""
    trainer = Trainer(_cfg(run_dir, extra), ctx)
    rows = [[r["loss"], r["grad_norm"]] for r in (trainer.train_step(s) for s in range(STEPS))]
    rows.append([trainer.validate()])
    weights, ema = whole_weights(trainer), trainer.ema.whole()
    return rows, (weights if ctx.rank == 0 else None), (ema if ctx.rank == 0 else None)


_REF: dict = {}


def reference(tmp_path_factory):
    if "ref" not in _REF:
        # micro-batches of 4, the layouts' of 2: a draw seeded by the row in the micro-batch,
        # or a loss that is not a mean per sample, differs
        ref = [("train.micro_batch_size", "4")]
        _REF["ref"] = harness.run(1, job_rows, str(tmp_path_factory.mktemp("dit-ref")), ref)[0]
    return _REF["ref"]


def assert_close(got, want, name: str, rel: float = 2e-5, norm_rel: float = 1e-4, wtol: float = 2e-5):
    rows = [g[0] for g in got]
    assert all(r == rows[0] for r in rows), f"{name}: ranks disagree: {rows}"
    for step, (g, w) in enumerate(zip(rows[0], want[0], strict=True)):
        for i, (a, b) in enumerate(zip(g, w, strict=True)):
            tol = (norm_rel if i == 1 else rel) * max(abs(b), 1e-3)
            what = "validation loss" if step == STEPS else f"step {step} " + ("grad norm" if i else "loss")
            assert abs(a - b) <= tol, f"{name} {what}: {a} vs one process {b}"
    assert set(got[0][2]) == set(want[2]), f"{name}: the EMA does not hold every parameter"
    for k, label in ((1, "weights"), (2, "EMA")):
        for n, w in want[k].items():
            if n not in got[0][k]:  # pp: rank 0's weights are its stage's
                continue
            err = (got[0][k][n] - w).abs().max().item()
            assert err <= wtol * max(1.0, w.abs().max().item()), f"{name}: {label} {n} off by {err:.2e}"


LAYOUTS = [
    ("dp2-zero1", 2, [("parallel.zero", "1")]),
    ("dp2-zero2", 2, [("parallel.zero", "2")]),
    ("dp2-zero3", 2, [("parallel.zero", "3")]),
    ("dp3", 3, []),
    ("tp2-sp", 2, [("parallel.tp", "2"), ("parallel.sequence_parallel", "true")]),
    (
        "dp2-tp2-sp-zero1",
        4,
        [("parallel.tp", "2"), ("parallel.sequence_parallel", "true"), ("parallel.zero", "1")],
    ),
    ("dp2-recompute-full", 2, [("memory.recompute", "full")]),
    ("tp2-recompute-selective", 2, [("parallel.tp", "2"), ("memory.recompute", "selective")]),
    ("pp2", 2, [("parallel.pp", "2")]),
    ("pp2-dp2-zero1", 4, [("parallel.pp", "2"), ("parallel.zero", "1")]),
]


@pytest.mark.parametrize("name,ws,extra", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_layout_equals_one_process(tmp_path_factory, name, ws, extra):
    want = reference(tmp_path_factory)
    got = harness.run(ws, job_rows, str(tmp_path_factory.mktemp(f"dit-{name}")), extra)
    assert_close(got, want, name)


def job_ema_by_hand(ctx, run_dir: str, extra: list):
    """The trainer's EMA against one kept by hand from the weights after each step."""
    trainer = Trainer(_cfg(run_dir, extra), ctx)
    d = trainer.cfg.flow.ema_decay
    avg = whole_weights(trainer)
    for s in range(STEPS):
        trainer.train_step(s)
        avg = {n: d * a + (1 - d) * w for (n, a), w in zip(avg.items(), whole_weights(trainer).values())}
    ema = trainer.ema.whole()
    return max((ema[n] - a).abs().max().item() for n, a in avg.items())


@pytest.mark.parametrize("ws,extra", [(1, []), (2, [("parallel.zero", "3")])], ids=["one", "dp2-zero3"])
def test_ema_is_the_average_of_each_steps_weights(tmp_path, ws, extra):
    assert max(harness.run(ws, job_ema_by_hand, str(tmp_path), extra)) < 1e-6


def job_resume(ctx, run_dir: str, extra: list, stop: int | None, first: list = ()):
    """Losses, val loss and EMA of steps [0, STEPS + 1): straight, or saved at `stop` (in the
    layout `first` sets) and resumed by a new Trainer in `extra`'s."""
    more = [("train.steps", str(STEPS + 1))]
    first = extra if stop is None else list(first)
    trainer = Trainer(config.load(None, BASE + [("run.dir", run_dir)] + more + first), ctx)
    losses = [trainer.train_step(s)["loss"] for s in range(stop or STEPS + 1)]
    if stop is not None:
        trainer._save(stop)
        resume = [("checkpoint.resume", "latest")]
        trainer = Trainer(config.load(None, BASE + [("run.dir", run_dir)] + more + extra + resume), ctx)
        assert trainer.start_step == stop
        losses += [trainer.train_step(s)["loss"] for s in range(stop, STEPS + 1)]
    ema = trainer.ema.whole()
    return losses, trainer.validate(), ema if ctx.rank == 0 else None


def test_resume_with_ema_equals_uninterrupted(tmp_path):
    straight = harness.run(1, job_resume, str(tmp_path / "a"), [], None)[0]
    resumed = harness.run(1, job_resume, str(tmp_path / "b"), [], 2)[0]
    assert resumed[:2] == straight[:2]  # bit for bit: losses and the validation loss
    assert all(torch.equal(resumed[2][n], e) for n, e in straight[2].items())


RESUMES = {
    "one-to-dp2-zero3": ([], [("parallel.zero", "3")]),
    "pp2-to-tp2-sp": ([("parallel.pp", "2")], [("parallel.tp", "2"), ("parallel.sequence_parallel", "true")]),
}


@pytest.mark.parametrize("name", list(RESUMES))
def test_resume_in_another_layout_keeps_the_ema(tmp_path, name):
    """Saved in one layout, resumed in another: the EMA is gathered whole (across pipeline
    stages too) and resliced exactly."""
    first, second = RESUMES[name]
    straight = harness.run(1, job_resume, str(tmp_path / "a"), [], None)[0]
    got = harness.run(2, job_resume, str(tmp_path / "b"), second, 2, first)[0]
    for a, b in zip(got[0], straight[0], strict=True):
        assert abs(a - b) <= 2e-5 * abs(b)
    for n, e in straight[2].items():
        assert (got[2][n] - e).abs().max().item() <= 2e-5 * max(1.0, e.abs().max().item()), n


def test_draws_follow_the_sample_not_its_row():
    """A sample's ε, t and label drop depend on (seed, sample_id) only: another batch around
    it, another position in it, give the same numbers; validation noise is fixed per sample."""
    f = Flow(seed=3, label_dropout=0.5, n_classes=10)
    x = torch.randn(6, 1, 8, 8)
    batch = {"images": x, "labels": torch.arange(6), "sample_id": torch.arange(100, 106)}
    whole = f.rows(batch)
    part = f.rows({k: v[[4, 1]] for k, v in batch.items()})
    for k in ("eps", "t", "y", "x_t"):
        assert torch.equal(part[k], whole[k][[4, 1]]), k
    assert (whole["y"] == 10).any() and (whole["y"] < 10).any()
    f.training = False
    val = f.rows(batch)
    assert val["t"].shape == (48,) and torch.equal(val["t"][:6], torch.full((6,), 1 / 16))
    assert torch.equal(val["eps"][:6], val["eps"][42:]) and torch.equal(val["y"][:6], batch["labels"])
    assert torch.equal(f.rows(batch)["eps"], val["eps"])  # the same at every evaluation


@pytest.mark.parametrize(
    "extra,match",
    [
        ([("train.objective", "lm")], "train.objective=lm with a 'dit' model"),
        ([("model.preset", "tiny")], "train.objective=flow needs a 'dit' model"),
        ([("memory.chunked_loss", "true")], "memory.chunked_loss=true applies to language models"),
        ([("flow.t_std", "0")], "flow.t_std=0.0 must be > 0"),
        ([("flow.ema_decay", "1")], r"flow.ema_decay=1.0 must be in \[0, 1\)"),
        ([("data.path", "/nonexistent/imgs")], "data.path='/nonexistent/imgs' does not exist; give 'digits'"),
    ],
)
def test_plan_refuses_in_one_line(tmp_path, extra, match):
    cfg = config.load(None, BASE + [("run.dir", str(tmp_path))] + extra)
    with pytest.raises(ConfigError, match=match) as e:
        make_plan(cfg, 2, ranks=False)
    assert "\n" not in str(e.value)
