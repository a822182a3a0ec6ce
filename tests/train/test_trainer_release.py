"""A dropped trainer frees what it held. A process that builds trainers one after another (a
benchmark sweep, a notebook, `meshspeed.parallelize` users) must not keep every earlier model,
gradient bucket and master alive: on a GPU each one is GiBs. The gradient hooks on the
parameters are the trap: a hook that holds its DataParallel strongly makes a cycle through the
parameters' C++ side that Python's collector cannot see."""

from __future__ import annotations

import gc
import weakref

import pytest

from meshspeed.plan import config
from tests import harness
from tests.memory.test_trainer_recompute import BASE

CASES = {
    "plain": [],
    "zero 3": [("parallel.zero", "3")],
    "2:4 sparsity": [("sparsity.pattern", "2:4")],
    "offload_optimizer": [("memory.offload_optimizer", "true"), ("train.dtype", "bfloat16")],
}


def job_release(ctx, run_dir: str, extra: list) -> dict:
    from meshspeed.train.trainer import Trainer

    over = BASE + [("run.dir", run_dir), ("parallel.tp", "1"), ("train.steps", "2")] + extra
    trainer = Trainer(config.load(None, over), ctx)
    trainer.train_step(0)
    trainer.metrics.close()
    refs = {"trainer": weakref.ref(trainer), "model": weakref.ref(trainer.model)}
    refs["a parameter"] = weakref.ref(next(trainer.model.parameters()))
    refs["a gradient bucket"] = weakref.ref(trainer.dp.buckets[0].grad)
    del trainer
    gc.collect()
    return {name: ref() is not None for name, ref in refs.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_a_dropped_trainer_frees_its_model_and_buckets(tmp_path, case):
    alive = harness.run(1, job_release, str(tmp_path), CASES[case], timeout=120)[0]
    assert not any(alive.values()), f"{case}: still alive after the trainer was dropped: {alive}"
