"""`--train.compile true` compiles each block whole, its communication inside: no graph break in
a block's forward or backward and no recompilation once the first two steps and an evaluation
have run, at one process and under tp 2 + SP (comm/traceable.py), counted from dynamo's own
records (meshspeed.train.compile_stats); and compiled tp 2 + SP equals eager (losses, 1e-5).

The trainer runs dynamo with the "aot_eager" backend (MESHSPEED_COMPILE_BACKEND) behind a
backend that reads each captured graph first: the same graphs, forward and backward
(AOTAutograd traces the backward at the first forward), without inductor's C++ build, which
takes minutes per graph on a shared 2-core CPU. torch 2.13 captures a `.item()` inside a block
as an unbacked scalar rather than breaking the graph, so the graphs are also read for host
reads (`.item()`, `.tolist()`, `aten._local_scalar_dense`): each is a device sync in the step.
The inductor-built parity sits in tests/train/test_compile.py's slow tier.
"""

from __future__ import annotations

import os

import pytest

from meshspeed.plan import config
from meshspeed.train.compile_stats import compile_stats
from meshspeed.train.trainer import Trainer
from tests import harness

BASE = [
    ("model.dim", "64"),
    ("model.n_layers", "2"),
    ("model.n_heads", "4"),
    ("model.n_kv_heads", "2"),
    ("train.seq_len", "16"),
    ("train.global_batch_size", "4"),
    ("train.micro_batch_size", "2"),
    ("train.dtype", "float32"),
    ("train.eval_interval", "0"),
    ("train.eval_batches", "1"),
    ("train.warmup_steps", "1"),
    ("data.max_mb", "0.2"),
]
STEPS = 4
JOB_S = 900.0
HOST_READS: list[str] = []  # per worker process: host reads found in the graphs captured


def _reading_backend(gm, example_inputs):
    import torch

    for n in gm.graph.nodes:
        if (n.op == "call_method" and n.target in ("item", "tolist")) or (
            n.op == "call_function" and n.target in (torch.ops.aten._local_scalar_dense.default,)
        ):
            where = [line.strip() for line in n.meta.get("stack_trace", "").splitlines() if "File" in line]
            HOST_READS.append(f"{n.target} at {where[-1:]}")
    return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


def _register_backend() -> None:
    import torch

    if "meshspeed_reading" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(_reading_backend, "meshspeed_reading")


def job_counts(ctx, run_dir: str, extra: list, eager_too: bool) -> dict:
    """Compiled: step 0, evaluation, step 1 (warm-up: first graphs, the grad-mode flip), then
    step 2, evaluation, step 3, evaluation; the counts of each part. With eager_too, the
    same steps without compile first, for the losses."""
    import torch

    _register_backend()
    os.environ["MESHSPEED_COMPILE_BACKEND"] = "meshspeed_reading"
    HOST_READS.clear()
    try:
        out: dict = {}
        for flag in ("false", "true") if eager_too else ("true",):
            torch._dynamo.reset()
            mine = [("run.dir", f"{run_dir}/{flag}"), ("train.compile", flag)]
            trainer = Trainer(config.load(None, BASE + extra + mine), ctx)
            start = compile_stats()
            rows = [trainer.train_step(0)]
            vals = [trainer.validate()]
            rows.append(trainer.train_step(1))
            warm = compile_stats()
            rows.append(trainer.train_step(2))
            vals.append(trainer.validate())
            rows.append(trainer.train_step(3))
            vals.append(trainer.validate())
            end = compile_stats()
            out[flag] = {"warmup": warm - start, "after": end - warm, "val": vals}
            out[flag].update(losses=[r["loss"] for r in rows], norms=[r["grad_norm"] for r in rows])
            out[flag]["compiled"] = trainer.features.compiled
        out["host_reads"] = list(HOST_READS)
        return out
    finally:
        os.environ.pop("MESHSPEED_COMPILE_BACKEND", None)


def _check_counts(results) -> None:
    for r in results:
        c = r["true"]
        print(f"compiled: warm-up {c['warmup']}; after {c['after']}; host reads {len(r['host_reads'])}")
        assert not r["host_reads"], f"host reads inside compiled code: {r['host_reads']}"
        assert c["compiled"] > 0, "no block was compiled"
        warm, after = c["warmup"], c["after"]
        assert warm.graphs > 0, f"nothing was compiled: {warm}"
        assert warm.graph_breaks == warm.unsupported == 0, f"graph breaks while warming up: {warm}"
        # after warm-up: nothing compiles again, evaluation included
        assert after.graph_breaks == after.unsupported == after.recompiles == after.graphs == 0, after


def test_one_process_compiles_whole_without_recompiles(tmp_path):
    _check_counts(harness.run(1, job_counts, str(tmp_path), [("parallel.tp", "1")], False, timeout=JOB_S))


def _check_parity(results) -> None:
    for r in results:
        eager, compiled = r["false"], r["true"]
        assert len(eager["losses"]) == len(compiled["losses"]) == STEPS
        for a, b in zip(eager["losses"] + eager["val"], compiled["losses"] + compiled["val"]):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (eager, compiled)
        for a, b in zip(eager["norms"], compiled["norms"]):
            assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), (eager, compiled)


def test_tp2_sp_compiles_whole_and_equals_eager(tmp_path):
    extra = [("parallel.tp", "2"), ("parallel.sequence_parallel", "true")]
    results = harness.run(2, job_counts, str(tmp_path), extra, True, timeout=JOB_S, timeout_s=JOB_S)
    _check_counts(results)
    _check_parity(results)


LAYOUTS = [
    ("dp2", 2, [("parallel.tp", "1")]),
    ("dp2-zero3", 2, [("parallel.tp", "1"), ("parallel.zero", "3")]),
    ("cp2-ring", 2, [("parallel.tp", "1"), ("parallel.cp", "2")]),
    ("cp2-ulysses", 2, [("parallel.tp", "1"), ("parallel.cp", "2"), ("parallel.cp_impl", "ulysses")]),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,world,extra", LAYOUTS, ids=[s[0] for s in LAYOUTS])
def test_layouts_compile_whole_without_recompiles(tmp_path, name, world, extra):
    results = harness.run(world, job_counts, str(tmp_path), extra, True, timeout=JOB_S, timeout_s=JOB_S)
    _check_counts(results)
    _check_parity(results)


if __name__ == "__main__":
    pytest.main([__file__, "-v"])
