"""`--train.compile true`: the trainer's first float32 losses equal eager ones (1e-5), in one
process and at tp 2; a block compiles without a graph break in one process; what compile does
not compose with is refused in one line.

Inductor's C++ backend compiles every block and the loss on first use, which takes minutes on a
small shared CPU: models are tiny, steps few, and the wider layouts sit behind `slow`. The
collectives' timeout is raised for these jobs (a rank compiling alone is not a hang).
"""

from __future__ import annotations

import pytest
import torch

from meshspeed.comm import ConfigError
from meshspeed.plan import config
from meshspeed.train.trainer import Trainer
from tests import harness

BASE = [
    ("model.dim", "64"),
    ("model.n_heads", "4"),
    ("model.n_kv_heads", "2"),
    ("train.seq_len", "16"),
    ("train.global_batch_size", "4"),
    ("train.micro_batch_size", "2"),
    ("train.dtype", "float32"),
    ("train.eval_interval", "0"),
    ("train.warmup_steps", "1"),
    ("data.max_mb", "0.2"),
]
STEPS = 2
JOB_S = 1800.0  # inductor on two shared cores: minutes per new graph


def job_eager_and_compiled(ctx, run_dir: str, extra: list) -> tuple[list[float], list[float], int]:
    """(eager losses, compiled losses, blocks compiled) of the same first steps."""
    runs = []
    for flag in ("false", "true"):
        extra_ = [("run.dir", f"{run_dir}/{flag}"), ("train.steps", str(STEPS)), ("train.compile", flag)]
        trainer = Trainer(config.load(None, BASE + extra + extra_), ctx)
        runs.append(([trainer.train_step(s)["loss"] for s in range(STEPS)], trainer.features.compiled))
    (eager, _), (compiled, n) = runs
    return eager, compiled, n


def _check(results) -> None:
    for eager, compiled, n in results:
        assert n > 0, "no block was compiled"
        assert len(eager) == len(compiled) == STEPS
        for a, b in zip(eager, compiled):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (eager, compiled)


def test_compiled_losses_equal_eager_one_process(tmp_path):
    _check(harness.run(1, job_eager_and_compiled, str(tmp_path), [("parallel.tp", "1")], timeout=JOB_S))


def test_compiled_losses_equal_eager_tp2(tmp_path):
    results = harness.run(
        2, job_eager_and_compiled, str(tmp_path), [("parallel.tp", "2")], timeout=JOB_S, timeout_s=JOB_S
    )
    _check(results)


SLOW_LAYOUTS = [
    ("tp2-sp", 2, [("parallel.tp", "2"), ("parallel.sequence_parallel", "true")]),
    ("pp2", 2, [("parallel.tp", "1"), ("parallel.pp", "2")]),
    ("dp2-zero3", 2, [("parallel.tp", "1"), ("parallel.zero", "3")]),
    ("cp2", 2, [("parallel.tp", "1"), ("parallel.cp", "2")]),
    ("recompute-full", 1, [("parallel.tp", "1"), ("memory.recompute", "full")]),
    ("moe-ep2", 2, [("parallel.tp", "1"), ("model.preset", "tiny-moe"), ("parallel.ep", "2")]),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,world,extra", SLOW_LAYOUTS, ids=[s[0] for s in SLOW_LAYOUTS])
def test_compiled_losses_equal_eager_layouts(tmp_path, name, world, extra):
    _check(harness.run(world, job_eager_and_compiled, str(tmp_path), extra, timeout=JOB_S, timeout_s=JOB_S))


def test_block_compiles_without_graph_breaks_and_blocks_share_a_graph():
    from torch._dynamo.utils import counters

    from meshspeed.models import build_model, get_preset, recipe_for
    from meshspeed.train.model_features import compile_blocks

    config_ = get_preset("tiny", dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=128)
    model = build_model(config_, seed=0)
    x = torch.randn(2, 8, 64)
    out = torch._dynamo.explain(model.layers["0"])(x, model.rope_cos[:8], model.rope_sin[:8])
    assert out.graph_break_count == 0, [str(b.reason)[:200] for b in out.break_reasons]
    assert out.graph_count == 1
    # the trainer's wrapping (dynamo's eager backend: tracing without inductor's build time)
    torch._dynamo.reset()
    counters.clear()
    assert compile_blocks(model, recipe_for(config_), fullgraph=True, backend="eager") == 3
    model(torch.randint(0, 128, (2, 8))).sum().backward()
    assert counters["stats"]["unique_graphs"] == 1  # one graph for every block, no recompiles


def test_compile_with_sparsity_is_refused():
    with pytest.raises(ConfigError, match="train.compile=true with sparsity.pattern='2:4'"):
        config.load(None, [("train.compile", "true"), ("sparsity.pattern", "2:4")])
