"""The dit family under tensor (+ sequence) parallelism equals the single-device model, forward
and gradients: the adaLN modulations (rows split, output gathered), the patch embedding's token
split, the final Linear's token gather, the text cross-attention's whole-input columns.

Every rank builds the single-device model with every parameter random (the zero-initialised
modulations too, so every gradient path carries signal), then the tensor-parallel copy of the
same weights; local gradients gathered to full shape must equal the reference. The model born
sharded (meta, split, each piece materialised) must hold exactly the sliced initial values.
"""

from __future__ import annotations

import copy

import pytest
import torch

from meshspeed import comm
from meshspeed.comm.placement import full_grad, sharding_of
from meshspeed.models import ModelConfig, build_model, recipe_for
from meshspeed.parallel.materialize import build_parallel_model
from meshspeed.parallel.tensor import parallelize
from meshspeed.train.objectives.flow import flow_loss, noisy
from tests import harness

# 36 image tokens and 12 heads split at tp 2, 3 and 4 (3 catches power-of-two assumptions); the
# text tokens (5) are never split.
CFG = dict(
    family="dit", dim=48, n_layers=2, n_heads=12, image_size=12, patch_size=2, in_channels=2,
    n_classes=5, learn_sigma=True, text_dim=6,
)  # fmt: skip


def _batch(cfg: ModelConfig):
    gen = torch.Generator().manual_seed(11)
    x0 = torch.randn(3, cfg.in_channels, 12, 12, generator=gen)
    eps = torch.randn(3, cfg.in_channels, 12, 12, generator=gen)
    t, y = torch.rand(3, generator=gen), torch.tensor([0, 4, 5])
    return x0, eps, t, y, torch.randn(3, 5, cfg.text_dim, generator=gen)


def _loss(model, batch):
    x0, eps, t, y, text = batch
    return flow_loss(model(noisy(x0, eps, t), t, y, text), x0, eps)


def job_dit_tp(ctx, sp: bool) -> list[str]:
    g = ctx.world
    cfg = ModelConfig(**CFG)
    recipe = recipe_for(cfg)
    ref = build_model(cfg, seed=3)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    batch = _batch(cfg)
    ref_loss = _loss(ref, batch)
    ref_loss.backward()
    want = {n: p.grad for n, p in ref.named_parameters()}

    mesh = comm.ParallelDims(tp=g.size).build(ctx)
    model = parallelize(copy.deepcopy(ref), mesh, recipe, sequence_parallel=sp)
    rows = []  # the text keys: every rank reads the 5 text tokens once (a sequence gather of the
    # whole text would repeat them tp times: the same attention, tp times the work)
    model.blocks["0"].cross.wk.register_forward_hook(lambda m, i, o: rows.append(o.shape[1]))
    loss = _loss(model, batch)
    loss.backward()
    bad = (
        []
        if torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-7)
        else [f"loss {loss.item()} != {ref_loss.item()}"]
    )
    if rows != [5]:
        bad.append(f"text keys computed over {rows} rows, want [5]")
    params = dict(model.named_parameters())
    if set(params) != set(want):
        bad.append(f"parameter names differ: {sorted(set(params) ^ set(want))}")
    sharded = 0
    for name, p in params.items():
        sharded += sharding_of(p) is not None
        got = full_grad(p, {"tp": g})
        scale = max(1.0, want[name].abs().max().item())  # float32 sums reassociated over ranks
        if got is None or not torch.allclose(got, want[name], rtol=1e-4, atol=1e-6 * scale):
            err = None if got is None else (got - want[name]).abs().max().item()
            bad.append(f"{name}: grad max err {err}")
    if sharded < 15 * cfg.n_layers:  # q k v o x2, fc1, fc2, modulation: weight and bias
        bad.append(f"only {sharded} sharded parameters")

    born = build_parallel_model(recipe, mesh, seed=3, sequence_parallel=sp)
    sliced = parallelize(build_model(cfg, seed=3), mesh, recipe, sequence_parallel=sp)
    for (n, p), (m, q) in zip(born.named_parameters(), sliced.named_parameters()):
        if n != m or not torch.equal(p, q) or sharding_of(p) != sharding_of(q):
            bad.append(f"born-sharded {n} differs from the sliced init")
    x0, eps, t, y, text = batch
    with torch.no_grad():  # positions recomputed after materialisation: the forward matches too
        if not torch.allclose(born(x0, t, y, text), sliced(x0, t, y, text), atol=1e-6):
            bad.append("born-sharded forward differs")
    return bad


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_dit_tensor_parallel_matches_single_device(tp):
    for sp in (False, True):
        assert harness.run(tp, job_dit_tp, sp) == [[]] * tp, f"sp={sp}"
