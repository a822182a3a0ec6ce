"""kernels.choose: the choice among equivalent kernels, with injected timings (CPU timings on a
shared machine decide nothing a test can rely on), and train.fused_kernels end to end."""

from __future__ import annotations

import pytest
import torch

from meshspeed.kernels import choose
from meshspeed.kernels.choose import KernelChooser, candidates

F32 = torch.float32


@pytest.fixture(autouse=True)
def _no_triton(monkeypatch):
    """Triton is a candidate only where a test says so (kernel tests elsewhere in the session
    set TRITON_INTERPRET=1 for the whole process)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


class FakeTimer:
    """Seconds per implementation from a table; every call is recorded."""

    def __init__(self, secs: dict[str, float]):
        self.secs, self.calls = secs, []

    def __call__(self, op, impl, shape, dtype, device):
        self.calls.append((op, impl, shape))
        return self.secs[impl]


def _chooser(secs, **kw):
    timer = FakeTimer(secs)
    return KernelChooser("cpu", timer=timer, **kw), timer


def test_faster_candidate_wins_beyond_the_margin(monkeypatch):
    pytest.importorskip("triton", reason="triton is in the dev extra: pip install -e .[dev]")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton counts as runnable
    chooser, _ = _chooser({"ref": 1.0, "triton": 0.9})
    assert chooser.pick("rms_norm", (8, 4), F32) == "triton"
    chooser, _ = _chooser({"ref": 1.0, "triton": 0.97})  # inside the 5% margin: a tie
    assert chooser.pick("rms_norm", (8, 4), F32) == "ref"
    chooser, _ = _chooser({"ref": 1.0, "triton": 1.5})  # slower: never taken
    assert chooser.pick("rms_norm", (8, 4), F32) == "ref"


def test_best_of_several_and_timed_once_per_shape():
    chooser, timer = _chooser({"ref": 1.0, "complex": 0.5})
    shape = (2, 8, 4, 2, 16)
    assert chooser.pick("rope", shape, F32) == "complex"
    assert chooser.pick("rope", shape, F32) == "complex"
    assert timer.calls == [("rope", "ref", shape), ("rope", "complex", shape)]
    chooser.pick("rope", (2, 16, 4, 2, 16), F32)  # another shape: timed again
    assert len(timer.calls) == 4


def test_triton_only_where_it_runs(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert candidates("swiglu", "cpu") == ["ref"]
    assert candidates("linear_ce", "cpu") == ["ref", "torch"]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    assert candidates("swiglu", "cpu") == ["ref", "triton"]


def test_ranks_decide_from_agreed_times():
    # this rank finds "torch" faster, another rank (max-reduced in) finds it slower: ref for both
    other = [1.0, 3.0]
    chooser, _ = _chooser({"ref": 1.0, "torch": 0.5}, agree=lambda s: [max(a, b) for a, b in zip(s, other)])
    assert chooser.pick("linear_ce", (64, 16, 256), F32) == "ref"
    assert chooser.times[("linear_ce", (64, 16, 256), F32)] == {"ref": 1.0, "torch": 3.0}


def test_each_decision_is_said_once():
    lines = []
    chooser, _ = _chooser({"ref": 2e-3, "torch": 1e-3}, say=lines.append)
    for _ in range(3):
        chooser.pick("linear_ce", (64, 16, 256), torch.bfloat16)
    assert lines == ["kernel linear_ce [64x16x256 bfloat16]: torch (ref 2 ms (1.00x), torch 1 ms (2.00x))"]


def test_only_the_reference_is_not_timed():
    chooser, timer = _chooser({})
    assert chooser.pick("swiglu", (8, 4), F32) == "ref" and timer.calls == []


def test_set_kernels_gives_each_site_its_shape(monkeypatch):
    from meshspeed.models import build_model, get_preset
    from meshspeed.models.layers import set_kernels

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # every op has a candidate to time
    pytest.importorskip("triton")
    config = get_preset("tiny", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_hidden=96)
    model = build_model(config, seed=0)
    chooser, timer = _chooser({"ref": 1.0, "complex": 0.1, "triton": 2.0})
    sites = set_kernels(model, chooser.pick, 2, 8, F32)
    assert sites == {"rms_norm": 5, "swiglu": 2, "rope": 2}
    shapes = {op: shape for op, _, shape in timer.calls}
    assert shapes == {
        "rms_norm": (16, 64),
        "add_rms_norm": (16, 64),
        "swiglu": (16, 96),
        "rope": (2, 8, 4, 2, 16),  # batch, seq, heads, kv heads, head_dim
    }
    assert {m.rope_impl for m in model.modules() if hasattr(m, "rope_impl")} == {"complex"}


def test_measure_times_forward_and_backward():
    for op, shape in (("add_rms_norm", (8, 16)), ("rope", (1, 4, 2, 1, 8)), ("linear_ce", (8, 16, 32))):
        for impl in candidates(op, "cpu"):
            assert choose.measure(op, impl, shape, F32, "cpu", repeats=1) > 0


# --- train.fused_kernels in the trainer ----------------------------------------------------


def job_losses(ctx, run_dir: str, fused: str) -> tuple[list[float], dict, list]:
    from meshspeed.plan import config
    from meshspeed.train.trainer import Trainer

    cfg = config.load(
        None,
        [
            ("model.dim", "64"),
            ("parallel.tp", "1"),
            ("train.seq_len", "16"),
            ("train.global_batch_size", "4"),
            ("train.micro_batch_size", "2"),
            ("train.eval_interval", "0"),
            ("train.steps", "2"),
            ("data.max_mb", "0.2"),
            ("train.fused_kernels", fused),
            ("run.dir", run_dir),
        ],
    )
    trainer = Trainer(cfg, ctx)
    return [trainer.train_step(s)["loss"] for s in range(2)], trainer.features.kernels, trainer.features.lines


def test_trainer_with_fused_kernels_equals_reference(tmp_path):
    """Whatever the timings pick on this machine, the losses are the reference's (float32)."""
    from tests import harness

    (want, _, _), (got, kernels, lines) = (
        harness.run(1, job_losses, str(tmp_path / f), f, timeout=600)[0] for f in ("false", "true")
    )
    assert set(kernels) == {"rms_norm", "add_rms_norm", "swiglu", "rope", "linear_ce"}
    # one line per op that had a candidate to time: rope and the head at least (Triton's ops too
    # when this session set TRITON_INTERPRET=1 before the workers started)
    said = [line.split()[1] for line in lines]
    assert len(said) == len(set(said)) and {"rope", "linear_ce"} <= set(said) <= set(kernels)
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-5 * abs(b), (got, want, kernels)
