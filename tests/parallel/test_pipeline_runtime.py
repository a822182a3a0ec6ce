"""The pipeline runtime against one process: every schedule, alone and with tp / dp, gives the
single-device loss and gradients (float32, 1e-5 relative); the trainer's losses and
checkpoints across pipeline layouts; bad settings fail at start-up with one line.

Several schedules run per harness job: forming process groups for a layout costs seconds,
running a schedule on this tiny model costs milliseconds.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from meshspeed import comm
from meshspeed.comm.placement import full_grad
from meshspeed.models import build_model, cross_entropy_loss, get_preset, recipe_for
from meshspeed.parallel.optim import build_data_parallel
from meshspeed.parallel.pipeline.runtime import PipelineRuntime
from meshspeed.parallel.pipeline.split_backward import split_backward
from meshspeed.parallel.pipeline.stage import build_stages, stage_layouts
from meshspeed.plan import config
from meshspeed.plan.run_plan import make_plan
from meshspeed.train.trainer import Trainer
from tests import harness, warm

MODEL = dict(n_layers=8, dim=32, n_heads=4, n_kv_heads=2)  # 8 layers: pp 4 × vpp 2 divides
MICRO, SEQ, M = 2, 16, 4  # micro-batch rows, sequence length, microbatches per step
ALL = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved-extra-warmup", 2), ("zero-bubble", 1)]


def _batch(rows: int, seed: int = 1):
    t = torch.randint(0, 256, (rows, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return t[:, :-1], t[:, 1:]


def job_grads(ctx, dims: dict, runs: list, preset: str = "tiny"):
    """Per run: (mean loss over the global batch, full gradients of this rank's parameters or
    None where a tp/dp peer reports the same)."""
    cfg = get_preset(preset, **MODEL)
    mesh = comm.ParallelDims(**dims).build(ctx)
    n_dp, r = mesh.dims.dp, mesh.coords["dp"]
    x, y = _batch(M * n_dp * MICRO)
    # dp rank r's a-th micro-batch: global rows [(a·dp + r)·micro, +micro), as the loader does
    rows = [slice((a * n_dp + r) * MICRO, (a * n_dp + r + 1) * MICRO) for a in range(M)]
    micro = [(x[s], y[s]) for s in rows]
    out = []
    for name, vpp, sp in runs:
        stages = build_stages(recipe_for(cfg), mesh, vpp=vpp, seed=0, sequence_parallel=sp)
        dp, _ = build_data_parallel(stages.model, mesh, dtype=torch.float32)
        rt = PipelineRuntime(stages, mesh, name, M, micro_batch_size=MICRO, seq_len=SEQ, sequence_parallel=sp)
        total = rt.train_step(micro, dp)
        dp.finish_grad_sync()
        loss = comm.all_reduce(total / M, mesh["dp"], "avg").item()
        grads = {n: full_grad(p, mesh) for n, p in stages.model.named_parameters()}
        val = comm.all_reduce(rt.evaluate(micro) / M, mesh["dp"], "avg").item()
        dp.remove_hooks()
        keep = mesh.coords["tp"] == 0 and r == 0
        out.append((name, vpp, sp, loss, val, grads if keep else None))
    return out


_REF: dict = {}


def _reference(preset: str, n_dp: int):
    if (preset, n_dp) not in _REF:
        model = build_model(get_preset(preset, **MODEL), seed=0)
        x, y = _batch(M * n_dp * MICRO)
        # mean of the micro-batch means (their aux losses included; MoE runs use dp 1, where
        # micro-batch a is rows [a·micro, (a+1)·micro)); the CE mean is over all rows
        step = len(x) // M
        loss = (
            sum(
                cross_entropy_loss(model(x[i * step : (i + 1) * step]), y[i * step : (i + 1) * step])
                + model.aux_loss()
                for i in range(M)
            )
            / M
        )
        ce = cross_entropy_loss(model(x), y).item()
        loss.backward()
        _REF[(preset, n_dp)] = ce, {n: p.grad.clone() for n, p in model.named_parameters()}
    return _REF[(preset, n_dp)]


def _check(results, n_dp: int, preset: str = "tiny") -> None:
    want_loss, want = _reference(preset, n_dp)
    for per_rank in zip(*results):
        name, vpp = per_rank[0][:2]
        seen = set()
        for _, _, _, loss, val, grads in per_rank:
            assert abs(loss - want_loss) <= 1e-5 * abs(want_loss), f"{name}: loss {loss} vs {want_loss}"
            assert abs(val - want_loss) <= 1e-5 * abs(want_loss), f"{name}: evaluate {val} vs {want_loss}"
            for fqn, g in (grads or {}).items():
                seen.add(fqn)
                err = ((g - want[fqn]).norm() / want[fqn].norm()).item()
                assert err <= 1e-5, f"{name} vpp {vpp}: {fqn} gradient off by {err:.2e} relative"
        assert seen == set(want), f"{name}: gradients missing for {sorted(set(want) - seen)[:4]}"


@pytest.mark.parametrize(
    "dims",
    [{"pp": 2}, {"pp": 4}, {"pp": 2, "tp": 2}, {"pp": 2, "dp": 2}],
    ids=["pp2", "pp4", "pp2-tp2", "pp2-dp2"],
)
def test_every_schedule_matches_one_process(dims):
    runs = [(name, vpp, False) for name, vpp in ALL]
    if dims.get("tp") == 2:  # and sequence parallelism: stage messages are [micro, seq/tp, dim]
        runs += [("1f1b", 1, True), ("zero-bubble", 1, True)]
    ws = dims.get("pp", 1) * dims.get("tp", 1) * dims.get("dp", 1)
    _check(harness.run(ws, job_grads, dims, runs), dims.get("dp", 1))


def test_moe_pipeline_with_split_backward_matches_one_process():
    runs = [("1f1b", 1, False), ("zero-bubble", 1, False)]
    _check(harness.run(2, job_grads, {"pp": 2}, runs, "tiny-moe"), 1, "tiny-moe")


def test_split_backward_defers_every_weight_gradient():
    model = build_model(get_preset("tiny-moe", **MODEL), seed=0)
    x, y = _batch(2)
    h = model.tok_embeddings(x).detach().requires_grad_()
    model.tok_embeddings = None
    cross_entropy_loss(model(h), y).backward()
    want_in, want = h.grad.clone(), {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    (got_in,), w = split_backward([cross_entropy_loss(model(h), y)], [None], [h], list(model.parameters()))
    assert all(p.grad is None for p in model.parameters())  # B computed no weight gradient
    assert w.full is None and len(w.groups) > 1  # the graph was cut, not replayed
    torch.testing.assert_close(got_in, want_in, rtol=0, atol=0)
    w.run()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-6, atol=1e-7)


# -- trainer --------------------------------------------------------------------------------
BASE = [
    ("model.n_layers", "4"),
    ("model.dim", "64"),
    ("train.seq_len", "32"),
    ("train.global_batch_size", "8"),
    ("train.micro_batch_size", "2"),
    ("train.dtype", "float32"),
    ("train.eval_interval", "2"),
    ("train.eval_batches", "1"),
    ("train.warmup_steps", "2"),
    ("train.steps", "4"),
    ("data.max_mb", "1"),
    ("parallel.tp", "1"),
]


def job_train(ctx, run_dir: str, extra: list):
    cfg = config.load(None, BASE + [("run.dir", run_dir)] + extra)
    return Trainer(cfg, ctx).run()["checkpoint"]


def _rows(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _close(got: list[dict], want: list[dict], what: str) -> None:
    for g in got:
        w = next(r for r in want if r["step"] == g["step"])
        # grad_norm at 1e-4: the float32 norm of a whole flat bucket is itself only good to ~2e-5
        # on CPU, and pipeline stages cut the buckets differently
        for key, tol in (("loss", 1e-5), ("val_loss", 1e-5), ("grad_norm", 1e-4)):
            if key in w:
                assert abs(g[key] - w[key]) <= tol * abs(w[key]), (
                    f"{what} step {g['step']} {key}: {g[key]} vs {w[key]}"
                )


def test_trainer_losses_and_checkpoints_across_pipeline_layouts(tmp_path):
    ref, a, b = str(tmp_path / "ref"), str(tmp_path / "pp2"), str(tmp_path / "pp2-from-pp1")
    # one process, 4 steps, checkpoints at 2 and 4
    harness.run(1, job_train, ref, [("checkpoint.interval", "2")])
    want = _rows(ref)
    # pp 2 (1F1B) trains steps 0-1 like one process, saves and exits at step 2 ...
    harness.run(2, job_train, a, [("parallel.pp", "2"), ("train.exit_interval", "2")])
    assert [r["step"] for r in _rows(a)] == [0, 1]
    # ... and one process resumes the pp 2 checkpoint (stage-local params -> whole model)
    harness.run(1, job_train, a, [("checkpoint.resume", "latest")])
    got = _rows(a)
    assert [r["step"] for r in got] == [0, 1, 2, 3]
    _close(got, want, "pp2 -> pp1")
    # pp 1's step-2 checkpoint resumed under pp 2 × vpp 2 (interleaved), tracing the pipeline
    harness.run(
        2,
        job_train,
        b,
        [
            ("parallel.pp", "2"),
            ("parallel.vpp", "2"),
            ("parallel.pp_schedule", "interleaved"),
            ("parallel.pp_trace", "true"),
            ("checkpoint.resume", os.path.join(ref, "step-000002")),
        ],
    )
    got = _rows(b)
    assert [r["step"] for r in got] == [2, 3]
    _close(got, want, "pp1 -> pp2 interleaved")
    trace = json.load(open(os.path.join(b, "pp_trace.json")))
    assert trace["step"] == 3 and 0 < trace["bubble_measured"] < 1 and 0 <= trace["bubble_simulated"] < 1
    assert len(trace["measured"]["timeline"]) == 2 and trace["measured"]["schedule"] == "interleaved"


# -- bad input ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "extra,ws,needle",
    [
        (
            [
                ("parallel.pp", "4"),
                ("parallel.vpp", "2"),
                ("parallel.pp_schedule", "interleaved"),
                ("train.global_batch_size", "4"),
            ],
            4,
            "microbatches=2 must be a multiple of pp=4",
        ),
        (
            [
                ("parallel.pp", "2"),
                ("parallel.vpp", "2"),
                ("parallel.pp_schedule", "interleaved"),
                ("model.n_layers", "6"),
            ],
            2,
            "parallel.vpp=2: n_layers=6 does not divide into pp*vpp = 4 equal model chunks",
        ),
        ([("parallel.pp", "4"), ("parallel.pp_layout", "2,0,1,1")], 4, "stage 1 is empty"),
        ([("parallel.pp", "4"), ("model.n_layers", "2")], 4, "n_layers=2 cannot fill pp*vpp = 4 stages"),
        ([("parallel.pp", "2"), ("parallel.pp_schedule", "interleaved")], 2, "needs parallel.vpp >= 2"),
        (
            [("parallel.pp", "2"), ("parallel.pp_layout", "3,3")],
            2,
            "places 6 layers but the model has n_layers=4",
        ),
        ([("parallel.vpp", "2")], 1, "parallel.vpp=2 needs parallel.pp > 1"),
    ],
)
def test_bad_pipeline_settings_fail_at_start_up(extra, ws, needle):
    cfg = config.load(None, BASE + extra)
    with pytest.raises(comm.ConfigError, match=None) as err:
        make_plan(cfg, ws)
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_tied_embeddings_are_refused_for_pp():
    with pytest.raises(comm.ConfigError, match="tied embeddings"):
        stage_layouts(recipe_for(get_preset("tiny", tie_embeddings=True)), pp=2)


def test_cli_bad_pipeline_setting_is_one_line(tmp_path):
    out = warm.run(
        [
            sys.executable,
            "-m",
            "meshspeed",
            "train",
            "--nproc",
            "2",
            "--parallel.tp",
            "1",
            "--parallel.pp",
            "2",
            "--parallel.pp_schedule",
            "interleaved",
            "--parallel.vpp",
            "2",
            "--model.n_layers",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "n_layers=2 cannot fill pp*vpp = 4 stages" in lines[0], out.stderr
