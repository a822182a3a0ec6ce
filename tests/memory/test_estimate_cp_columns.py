"""Every column of the run plan's memory estimate under context parallelism (cp 2, dp 1),
against bytes counted on a real trainer as tests/memory/test_estimate_counted.py counts them.

That file's cp test compares the state (params, grads, optimizer) only. Under cp a rank holds
s/cp tokens of each sequence, so the loss's backward makes two float32 [mbs · s/cp, vocab]
gradients: buffers must equal them exactly (counted at the operators that return them, as
there, with this rank's logits' size); host is 0; activations and total carry the ring
attention model's known gap, bounded below.
"""

from __future__ import annotations

import torch

from meshspeed.memory import count_saved
from meshspeed.plan import config
from meshspeed.plan.run_plan import make_plan
from tests import harness
from tests.memory.test_estimate_counted import BASE, MB, SCALARS, SEQ, LossBackward, _count_state

CP = 2
ROW = [("parallel.cp", str(CP)), ("parallel.zero", "1")]
# The estimate's activations under cp exceed the counted bytes (a gap in its model of ring
# attention, stated in test_estimate_counted.py: 1,527,168 against 1,463,940 per rank, 4.3%).
# Allowed: the estimate from the counted bytes less the ids' int64 [mbs, s/cp] it omits, to 5%
# above them.
ACT_OVER = 0.05


def job_cp_row(ctx, run_dir: str) -> dict:
    from meshspeed.train.trainer import Trainer

    cfg = config.load(None, BASE + ROW + [("run.dir", run_dir)])
    plan = make_plan(cfg, ctx.world_size)
    est = plan.ranks[ctx.rank]["memory"]
    trainer = Trainer(cfg, ctx, plan)
    trainer.train_step(0)  # the optimizer state and buffers as every later step holds them
    got = _count_state(trainer)
    vocab = trainer.model_config.vocab_size
    gen = torch.Generator().manual_seed(ctx.rank)
    x, y = torch.randint(0, vocab, (2, MB, SEQ), generator=gen)  # whole sequences: _loss cuts s/cp
    with count_saved(trainer.model) as c:
        ce, aux = trainer._loss(x, y)
    got["activations"] = c.bytes
    # this rank's logits: [MB, SEQ / cp, vocab]; the whole sequence's would be CP times that
    with LossBackward(MB * SEQ // CP * vocab) as mine, LossBackward(MB * SEQ * vocab) as whole:
        (ce if aux is None else ce + aux).backward()
    trainer.dp.zero_grad()
    got["loss_backward"], got["whole_sequence_loss_backward"] = mine.bytes, whole.bytes
    return {"est": est, "got": got, "dims": plan.dims}


def test_every_column_of_the_estimate_under_cp(tmp_path):
    bad = []
    for rank, r in enumerate(harness.run(2, job_cp_row, str(tmp_path))):
        est, got = r["est"], r["got"]
        assert r["dims"]["cp"] == CP and r["dims"]["dp"] == 1, r["dims"]
        # the loss's backward ran on this rank's s/cp tokens, never on whole sequences
        assert got["loss_backward"] > 0 and got["whole_sequence_loss_backward"] == 0, got
        exact = {
            "params": got["params"],
            "grads": got["grads"],
            "optimizer": got["optimizer"],
            "host": got["host"],
            "buffers": got["loss_backward"],  # tp 1: no SP gather; zero 1: nothing gathered
        }
        bad += [
            f"rank {rank} {k}: estimated {est[k]:,}, counted {v:,}" for k, v in exact.items() if est[k] != v
        ]
        ids = 8 * MB * SEQ // CP  # the token ids the embedding keeps: not estimated
        lo, hi = got["activations"] - ids - SCALARS, got["activations"] * (1 + ACT_OVER)
        if not lo <= est["activations"] <= hi:
            bad.append(
                f"rank {rank} activations: estimated {est['activations']:,}, counted {got['activations']:,}"
            )
        state = got["device"]  # the storages taken as one set, not the estimator's own sum
        total = state + got["activations"] + got["loss_backward"]
        if not total - ids - SCALARS <= est["total"] <= total + ACT_OVER * got["activations"]:
            bad.append(f"rank {rank} total: estimated {est['total']:,}, counted {total:,}")
    assert not bad, "\n".join(bad)
