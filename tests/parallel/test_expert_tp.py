"""Expert parallelism with tensor parallelism (etp = tp, etp = 1, tp-extend-ep) against one process.

Model level: every rank builds the single-device model from one seed and runs it on each
data-parallel replica's tokens (one process's gradient accumulation: the MoE router losses are
per micro-batch), then the parallel model (tp-sharded as usual, MoE layers made expert- and
tensor-parallel as the trainer does) on its replica's tokens. Compared: the loss, and every
parameter's gradient after the (expert-)data-parallel reduction, gathered to full shape from
its Sharding tags (which must therefore describe the splits). float32, rtol 1e-5.

The mesh's ep / edp groups for each mode are checked against hand-written rank lists.
"""

from __future__ import annotations

import pytest
import torch

from meshspeed import comm
from meshspeed.comm import ParallelDims
from meshspeed.comm.placement import full_grad, sharding_of
from meshspeed.models import build_model, cross_entropy_loss, get_preset, recipe_for
from meshspeed.parallel.expert import expert_params, sync_grads
from meshspeed.parallel.expert_tp import ExpertTensorParallelMoE, expert_tensor_parallel
from meshspeed.parallel.materialize import build_parallel_model
from meshspeed.parallel.tensor import model_loss
from tests import harness

BATCH = 2  # sequences per replica

KWARGS = {"split": {}, "tokens": {"etp": 1}, "fold": {"tp_extend_ep": True}}


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    scale = max(1.0, b.abs().max().item()) if b.numel() else 1.0
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6 * scale)


def job_model(ctx, preset: str, overrides: dict, dims: dict, mode: str, sp: bool, dispatcher: str, seq: int):
    dims = ParallelDims(**dims, **KWARGS[mode])
    mesh = dims.build(ctx)
    config = get_preset(preset, **overrides)
    dp, d = mesh["dp"].size, mesh.coords["dp"]
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, config.vocab_size, (dp * BATCH, seq), generator=gen)
    targets = torch.randint(0, config.vocab_size, (dp * BATCH, seq), generator=gen)

    # one process: the mean over replicas of each replica's loss (its CE + its router losses)
    ref = build_model(config, seed=3)
    ref_losses = [
        cross_entropy_loss(ref(tokens[i * BATCH : (i + 1) * BATCH]), targets[i * BATCH : (i + 1) * BATCH])
        + ref.aux_loss()
        for i in range(dp)
    ]
    torch.stack(ref_losses).mean().backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}

    recipe = recipe_for(config)
    model = build_parallel_model(recipe, mesh, seed=3, sequence_parallel=sp)
    expert_tensor_parallel(model, mesh["ep"], mesh["tp"], mode, sp, dispatcher)
    rows = slice(d * BATCH, (d + 1) * BATCH)
    loss = model_loss(model, tokens[rows], targets[rows])
    loss.backward()
    sync_grads(model, mesh)

    bad = []
    if not _close(loss.detach(), ref_losses[d].detach()):
        bad.append(f"loss {loss.item()} != {ref_losses[d].item()}")
    layers = [m for m in model.modules() if isinstance(m, ExpertTensorParallelMoE)]
    if len(layers) != sum(config.is_moe_layer(i) for i in range(config.n_layers)):
        bad.append(f"{len(layers)} MoE layers replaced")
    want_axes = {"split": {"tp", "ep"}, "tokens": {"ep"}, "fold": {"ep"}}[mode]
    expert, _ = expert_params(model)
    for p in expert:
        s = sharding_of(p)
        if {a for a, _ in s.axes} != want_axes:
            bad.append(f"expert weight {s}: want axes {want_axes}")
    want_ep = dims.ep * (dims.tp if mode == "fold" else 1)
    if mesh["ep"].size != want_ep:
        bad.append(f"ep group of {mesh['ep'].size}, want {want_ep}")
    groups = {"tp": mesh["tp"], "ep": mesh["ep"]}
    params = dict(model.named_parameters())
    if set(params) != set(ref_grads):
        bad.append(f"parameter names differ: {sorted(set(params) ^ set(ref_grads))}")
    for name, p in params.items():
        got, want = full_grad(p, groups), ref_grads[name]
        if got is None or not _close(got, want):
            err = None if got is None or got.shape != want.shape else (got - want).abs().max().item()
            bad.append(f"{name}: grad max err {err}")
    return bad


EP2_TP2 = {"dp": 2, "tp": 2, "ep": 2}
CASES = [(mode, sp) for mode in ("split", "tokens", "fold") for sp in (False, True)]


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-fine-moe"])
@pytest.mark.parametrize("mode,sp", CASES, ids=[f"{m}-{'sp' if s else 'nosp'}" for m, s in CASES])
def test_ep2_tp2_model_matches_one_process(preset, mode, sp):
    got = harness.run(4, job_model, preset, {}, EP2_TP2, mode, sp, "alltoall", 8)
    assert got == [[]] * 4


@pytest.mark.parametrize("mode", ["split", "tokens", "fold"])
def test_allgather_dispatcher_under_tp(mode):
    got = harness.run(4, job_model, "tiny-moe", {}, EP2_TP2, mode, False, "allgather", 8)
    assert got == [[]] * 4


# tp 3 (heads and experts divide by 3): ep 1, so the expert group is tp itself (fold: 3 expert
# ranks) or whole experts with the tokens split three ways; without SP, 16 tokens per replica
# split unevenly (6, 5, 5), which the allgather dispatcher's sizes must follow in fold mode.
TP3 = dict(dim=96, n_heads=3, n_kv_heads=3, n_experts=6, moe_ffn_hidden=40)
TP3_CASES = [
    ("fold", False, "alltoall"),
    ("fold", True, "alltoall"),
    ("fold", False, "allgather"),
    ("tokens", False, "alltoall"),
    ("split", True, "alltoall"),
]


@pytest.mark.parametrize("mode,sp,dispatcher", TP3_CASES)
def test_world_3_tp3_model_matches_one_process(mode, sp, dispatcher):
    got = harness.run(3, job_model, "tiny-moe", TP3, {"tp": 3}, mode, sp, dispatcher, 9 if sp else 8)
    assert got == [[]] * 3


# --- the mesh ----------------------------------------------------------------------------------


def _mine(parts: list[list[int]], rank: int) -> list[int]:
    return next(g for g in parts if rank in g)


def test_mesh_expert_groups_for_each_mode():
    # world 8 = dp 4 × tp 2, ep 2: ranks (dp_i, tp_i) -> 2·dp_i + tp_i; ep blocks {dp 0,1}, {dp 2,3}
    split = ParallelDims(dp=4, tp=2, ep=2).partitions()
    assert _mine(split["ep"], 0) == [0, 2] and _mine(split["edp"], 0) == [0, 4]
    assert _mine(split["ep"], 3) == [1, 3] and _mine(split["edp"], 3) == [3, 7]
    tokens = ParallelDims(dp=4, tp=2, ep=2, etp=1).partitions()
    assert _mine(tokens["ep"], 0) == [0, 2] and _mine(tokens["edp"], 0) == [0, 1, 4, 5]
    fold = ParallelDims(dp=4, tp=2, ep=2, tp_extend_ep=True).partitions()
    assert _mine(fold["ep"], 0) == [0, 1, 2, 3] and _mine(fold["edp"], 1) == [1, 5]
    for kw in ({}, {"etp": 1}, {"tp_extend_ep": True}):
        dims = ParallelDims(dp=4, tp=2, ep=2, **kw)
        parts = dims.partitions()
        for name in ("ep", "edp"):
            assert sorted(r for g in parts[name] for r in g) == list(range(8))
            for rank in range(8):  # a rank's coordinate is its index in its group
                group = _mine(parts[name], rank)
                assert group.index(rank) == dims.coords(rank)[name] and len(group) == dims.size(name)


def test_bad_expert_tp_settings_are_one_line():
    with pytest.raises(comm.ConfigError, match=r"^parallel.etp=3 must be 1 .* or tp=2"):
        ParallelDims(dp=2, tp=2, etp=3)
    with pytest.raises(comm.ConfigError, match=r"^moe.tp_extend_ep=True with parallel.etp=2"):
        ParallelDims(dp=2, tp=2, tp_extend_ep=True, etp=2)
