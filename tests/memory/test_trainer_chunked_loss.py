"""`--memory.chunked_loss` in the trainer: losses and gradient norms equal the run without it
(float32, ≤ 1e-5 relative: only the summation order changes) under dp 2 × tp 2 (vocab-parallel
loss per chunk), with sequence parallelism (each rank's block cut in chunks, gathered per
chunk), dp 4 + ZeRO-1, cp 2, pp 2 (the last stage's loss) and pp 2 × tp 2 with SP; a bad chunk
is one line in the plan."""

from __future__ import annotations

import pytest

from meshspeed.comm import ConfigError
from meshspeed.plan import config
from meshspeed.plan.run_plan import make_plan
from tests import harness
from tests.memory.test_trainer_recompute import BASE

LAYOUTS = {
    "dp2-tp2": [("parallel.tp", "2")],
    "dp4-zero1": [("parallel.tp", "1"), ("parallel.zero", "1")],
    "dp2-cp2": [("parallel.tp", "1"), ("parallel.cp", "2")],
    "dp2-tp2-sp": [("parallel.tp", "2"), ("parallel.sequence_parallel", "true")],
    "pp2-dp2": [("parallel.tp", "1"), ("parallel.pp", "2")],
    "pp2-tp2-sp": [("parallel.tp", "2"), ("parallel.pp", "2"), ("parallel.sequence_parallel", "true")],
}


def job_losses(ctx, run_dir: str, extra: list, steps: int) -> list:
    import sys

    from meshspeed.train.trainer import Trainer

    cl = sys.modules["meshspeed.memory.chunked_loss"]  # the module (the package exports the function)

    out, real, calls = [], cl.chunked_loss, []
    cl.chunked_loss = lambda *a, **k: (calls.append(1), real(*a, **k))[1]  # the chunked path ran
    try:
        for chunked in ("false", "true"):
            over = BASE + [("run.dir", f"{run_dir}/{chunked}"), ("train.steps", str(steps))] + extra
            over += [("memory.chunked_loss", chunked), ("memory.loss_chunk", "7")]  # 32 = 4 × 7 + 4
            trainer = Trainer(config.load(None, over), ctx)
            rows = [trainer.train_step(s) for s in range(steps)]
            out.append(([r["loss"] for r in rows], [r["grad_norm"] for r in rows]))
    finally:
        cl.chunked_loss = real
    return out + [len(calls)]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_chunked_loss_trains_like_the_full_logits(tmp_path, name):
    got = harness.run(4, job_losses, str(tmp_path), LAYOUTS[name], 3, timeout=300)
    (plain, plain_norms), (chunked, norms), _ = got[0]
    assert chunked == pytest.approx(plain, rel=1e-5), f"{name}: {chunked} vs {plain}"
    # the gradients too: a chunk's loss scaled by its own count instead of the whole batch's
    # would barely move AdamW's losses
    assert norms == pytest.approx(plain_norms, rel=1e-5), f"{name}: {norms} vs {plain_norms}"
    assert sum(calls for _, _, calls in got) > 0, "no rank took the chunked loss"
    assert plain[-1] < plain[0]


@pytest.mark.parametrize(
    "extra,needle",
    [
        ([("memory.loss_chunk", "0")], "memory.loss_chunk=0 must be ≥ 1"),
    ],
)
def test_impossible_combinations_are_one_line(tmp_path, extra, needle):
    over = BASE + [("run.dir", str(tmp_path)), ("memory.chunked_loss", "true")] + extra
    with pytest.raises(ConfigError, match=needle):
        make_plan(config.load(None, over), 4)
