"""`--memory.chunked_loss` in the trainer: losses equal the run without it (float32, ≤ 1e-5
relative: only the summation order changes) under dp 2 × tp 2 (vocab-parallel loss per chunk),
dp 4 + ZeRO-1 and cp 2; the setting's impossible combinations are one line in the plan."""

from __future__ import annotations

import pytest

from meshspeed.comm import ConfigError
from meshspeed.train import config
from meshspeed.train.plan import make_plan
from tests import harness
from tests.memory.test_trainer_recompute import BASE

LAYOUTS = {
    "dp2-tp2": [("parallel.tp", "2")],
    "dp4-zero1": [("parallel.tp", "1"), ("parallel.zero", "1")],
    "dp2-cp2": [("parallel.tp", "1"), ("parallel.cp", "2")],
}


def job_losses(ctx, run_dir: str, extra: list, steps: int) -> list[list[float]]:
    from meshspeed.train.trainer import Trainer

    out = []
    for chunked in ("false", "true"):
        over = BASE + [("run.dir", f"{run_dir}/{chunked}"), ("train.steps", str(steps))] + extra
        over += [("memory.chunked_loss", chunked), ("memory.loss_chunk", "7")]  # 32 = 4 × 7 + 4
        trainer = Trainer(config.load(None, over), ctx)
        out.append([trainer.train_step(s)["loss"] for s in range(steps)])
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_chunked_loss_trains_like_the_full_logits(tmp_path, name):
    plain, chunked = harness.run(4, job_losses, str(tmp_path), LAYOUTS[name], 3, timeout=300)[0]
    assert chunked == pytest.approx(plain, rel=1e-5), f"{name}: {chunked} vs {plain}"
    assert plain[-1] < plain[0]


@pytest.mark.parametrize(
    "extra,needle",
    [
        ([("parallel.tp", "2"), ("parallel.sequence_parallel", "true")], "with parallel.sequence_parallel"),
        ([("parallel.tp", "1"), ("parallel.pp", "2")], "with parallel.pp=2 is not supported yet"),
        ([("memory.loss_chunk", "0")], "memory.loss_chunk=0 must be ≥ 1"),
    ],
)
def test_impossible_combinations_are_one_line(tmp_path, extra, needle):
    over = BASE + [("run.dir", str(tmp_path)), ("memory.chunked_loss", "true")] + extra
    with pytest.raises(ConfigError, match=needle):
        make_plan(config.load(None, over), 4)
