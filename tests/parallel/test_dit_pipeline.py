"""The dit family under pipeline parallelism equals one device, forward and gradients: the
conditioning c made on stage 0 travels to every later stage as row 0 of the one activation the
runtime sends (dit_recipe.pack), and its gradient comes back in that row to the timestep and
class embedders on stage 0.

Schedules 1f1b, interleaved (vpp 2), zero-bubble (its W owns every stage-0 module's weight
gradient) and gpipe at pp 2; pp 2 × tp 2 with sequence parallelism (each tp rank packs its token
shard with the whole c) and pp 2 × cp 2 (ring, full attention; each cp rank packs its token
slice). Every parameter is random (the zero-initialised modulations too), so every path carries
a gradient. The last stage's output of each micro-batch is checked, then the mean loss (training
and evaluation) and each rank's parameter gradients.
"""

from __future__ import annotations

import pytest
import torch

from meshspeed import comm
from meshspeed.comm.placement import full_grad
from meshspeed.models import ModelConfig, recipe_for
from meshspeed.parallel.context import apply_context_parallel, context_parallel
from meshspeed.parallel.pipeline.runtime import PipelineRuntime
from meshspeed.parallel.pipeline.schedules import get_schedule
from meshspeed.parallel.pipeline.stage import build_stages
from meshspeed.train.objectives.flow import flow_loss, noisy
from tests import harness
from tests.parallel.test_context import close
from tests.parallel.test_context_full import random_reference

CFG = dict(
    family="dit", dim=48, n_layers=4, n_heads=12, image_size=12, patch_size=2, in_channels=2,
    n_classes=5, learn_sigma=True,
)  # fmt: skip
MICRO, M = 2, 4  # rows per micro-batch, micro-batches per step (interleaved: a multiple of pp)


def _micro(cfg: ModelConfig) -> list[dict]:
    gen = torch.Generator().manual_seed(11)
    n = MICRO * M
    x0, eps = (torch.randn(n, cfg.in_channels, 12, 12, generator=gen) for _ in range(2))
    t, y = torch.rand(n, generator=gen), torch.randint(0, cfg.n_classes + 1, (n,), generator=gen)
    rows = {"x0": x0, "eps": eps, "t": t, "y": y, "x_t": noisy(x0, eps, t)}  # flow's row names
    return [{k: v[a * MICRO : (a + 1) * MICRO] for k, v in rows.items()} for a in range(M)]


def job_dit_pp(ctx, dims: dict, runs: list) -> list[str]:
    cfg = ModelConfig(**CFG)
    recipe, ref = random_reference(cfg)
    micro = _micro(cfg)
    whole = {k: torch.cat([mb[k] for mb in micro]) for k in micro[0]}
    ref_out = ref(whole["x_t"], whole["t"], whole["y"])
    ref_loss = flow_loss(ref_out, whole["x0"], whole["eps"])
    ref_loss.backward()
    want = dict(ref.named_parameters())

    mesh = comm.ParallelDims(**dims).build(ctx)
    cp = context_parallel(mesh, "ring", causal=recipe.causal) if mesh.dims.cp > 1 else None
    bad = []
    for name, vpp, sp in runs:
        stages = build_stages(
            recipe, mesh, vpp=vpp, sequence_parallel=sp, placement=get_schedule(name).placement
        )
        if cp is not None:
            apply_context_parallel(stages.model, cp, tokens=recipe.cp_tokens)
        rt = PipelineRuntime(
            stages,
            mesh,
            name,
            M,
            micro_batch_size=MICRO,
            seq_len=recipe.pipeline.seq_len,
            sequence_parallel=sp,
            positions=None if cp is None else cp.positions(recipe.pipeline.seq_len),
        )
        outs = []

        def objective(forward, mb):
            out = forward()
            outs.append(out.detach())
            return flow_loss(out, mb["x0"], mb["eps"]), None

        rt.objective = objective
        tag = f"{name} vpp={vpp} sp={sp}"
        loss = rt.train_step(micro) / M
        if outs and not close(torch.cat(outs), ref_out.detach()):
            bad.append(f"{tag}: output max err {(torch.cat(outs) - ref_out).abs().max().item():.3g}")
        if abs(loss.item() - ref_loss.item()) > 1e-5 * ref_loss.item():
            bad.append(f"{tag}: loss {loss.item()} != {ref_loss.item()}")
        for n, p in stages.model.named_parameters():
            if cp is not None:  # the trainer's dp_cp reduction averages over cp
                comm.all_reduce(p.grad, mesh["cp"], "avg")
            got = full_grad(p, {"tp": mesh["tp"]})
            if not close(got, want[n].grad):
                err = "missing" if got is None else f"max err {(got - want[n].grad).abs().max().item():.3g}"
                bad.append(f"{tag}: {n} grad {err}")
        val = rt.evaluate(micro) / M
        if abs(val.item() - ref_loss.item()) > 1e-5 * ref_loss.item():
            bad.append(f"{tag}: evaluation loss {val.item()} != {ref_loss.item()}")
    return bad


ALL = [("1f1b", 1, False), ("interleaved", 2, False), ("zero-bubble", 1, False), ("gpipe", 1, False)]


@pytest.mark.parametrize(
    "ws,dims,runs",
    [
        (2, dict(pp=2), ALL),
        (4, dict(pp=2, tp=2), [("1f1b", 1, True), ("interleaved", 2, True)]),
        (4, dict(pp=2, cp=2), [("1f1b", 1, False)]),
    ],
    ids=["pp2", "pp2-tp2-sp", "pp2-cp2"],
)
def test_dit_pipeline_matches_single_device(ws, dims, runs):
    assert harness.run(ws, job_dit_pp, dims, runs) == [[]] * ws


def test_stage_zero_holds_and_splits_every_conditioning_module():
    """Stage 0 alone holds the patch, timestep and class embedders (a later stage holding them
    would train copies nobody uses and checkpoint them twice), and a split schedule's W owns all
    their weight gradients (the built-in split schedules fuse stage 0's W with its B, so no
    parity run reaches that path)."""
    from meshspeed.comm.recipe import build_on_meta
    from meshspeed.parallel.pipeline.stage import StageChunk, keep_stage, stage_layouts

    recipe = recipe_for(ModelConfig(**CFG))
    layouts = stage_layouts(recipe, 2)
    first = ("x_embedder.", "t_embedder.", "y_embedder.")
    for rank in (0, 1):
        model = build_on_meta(recipe)
        keep_stage(recipe, layouts, rank)(model)
        held = {n for n, _ in model.named_parameters() if n.startswith(first)}
        assert bool(held) == (rank == 0), held
        if rank == 0:
            chunk = StageChunk(model, recipe, layouts[0], 2)
            want = {id(p) for n, p in model.named_parameters() if n.startswith(first)}
            assert {id(p) for p in chunk.embedding_params()} == want


# --- through the Trainer: train.objective=flow on the built-in digits ------------------------

FLOW_PP = [
    ("pp2-1f1b", 2, [("parallel.pp", "2")]),
    ("pp2-interleaved-cp2", 4, [("parallel.pp", "2"), ("parallel.vpp", "2"), ("parallel.pp_schedule",
     "interleaved"), ("parallel.cp", "2"), ("parallel.cp_impl", "ulysses")]),
]  # fmt: skip


@pytest.mark.parametrize("name,ws,extra", FLOW_PP, ids=[x[0] for x in FLOW_PP])
def test_flow_training_under_pp_equals_single_process(tmp_path_factory, name, ws, extra):
    from tests.parallel.test_context_full import _FLOW_REF, job_flow_losses
    from tests.train.test_trainer import assert_rows_close

    if not _FLOW_REF:
        ref_dir = str(tmp_path_factory.mktemp("flow-ref"))
        _FLOW_REF.append(harness.run(1, job_flow_losses, ref_dir, [], timeout=180)[0])
    got = harness.run(ws, job_flow_losses, str(tmp_path_factory.mktemp(name)), extra, timeout=240)
    assert_rows_close(got, _FLOW_REF[0], name)
