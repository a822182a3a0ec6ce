"""`meshspeed.parallelize` on a diffusers DiTTransformer2DModel (issue 41 item 7): a user's own
rectified-flow loop on the parallelized diffusers model at dp 2 (ZeRO-1, -2 and -3, whose
blocks' conditioning embedders stay in the root unit), dp 3 (ZeRO-3), and with context
parallelism over its image tokens (cp 2 ring, cp 2 Ulysses, dp 2 × cp 2 hybrid with ZeRO-3)
equals the same loop on one process without meshspeed: the losses, every parameter's gradient
(ZeRO-1, where the reduced gradients stay whole), the global gradient norms and the weights
after the steps.

The loop runs the model in eval() mode: in train() mode diffusers' class embedder drops labels
itself (class_dropout_prob 0.1, torch's global RNG), so each rank would drop others than one
process does; classifier-free-guidance dropout belongs in the data (train/objectives/flow.py)."""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch
import torch.nn.functional as F

from meshspeed import comm
from tests import harness
from tests.interop.test_diffusers_io import diffusers_model

# diffusers is imported by the jobs, not here (the spawned ranks import this module)
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("diffusers") is None, reason="diffusers is a dev extra (the dit oracle)"
)

STEPS, BATCH, LR, CLIP, EPS = 2, 6, 1e-2, 1.0, 1e-8  # 6: split by dp 2 and 3


def batches(steps: int = STEPS) -> list[tuple[torch.Tensor, ...]]:
    """(x_t, diffusers timestep, class, velocity target) per step: a rectified-flow batch."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        x0, noise = torch.randn(BATCH, 1, 8, 8, generator=g), torch.randn(BATCH, 1, 8, 8, generator=g)
        t = torch.rand(BATCH, generator=g)
        xt = (1 - t[:, None, None, None]) * x0 + t[:, None, None, None] * noise
        out.append((xt, 1000.0 * t, torch.randint(0, 11, (BATCH,), generator=g), noise - x0))
    return out


def loss_of(model, xt, t, y, v) -> torch.Tensor:
    pred = model(xt, timestep=t, class_labels=y).sample[:, : v.shape[1]]  # learn_sigma: velocity first
    return F.mse_loss(pred, v)


@functools.cache
def one_process(steps: int = STEPS):
    """The loop without meshspeed: (losses, norms, step-0 gradients, final weights)."""
    model = diffusers_model(seed=2)  # eval(): see the docstring
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses, norms, grads = [], [], None
    for step, b in enumerate(batches(steps)):
        loss = loss_of(model, *b)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, grads, {k: v.clone() for k, v in model.state_dict().items()}


def job_loop(ctx, dims: dict, kw: dict, steps: int = STEPS):
    import meshspeed

    model = diffusers_model(seed=2)  # eval(): see the docstring
    mesh = comm.ParallelDims(**dims).build(ctx)
    model, opt = meshspeed.parallelize(model, mesh, lr=LR, eps=EPS, **kw)
    st = model.meshspeed
    rows = BATCH // st.dp_size
    losses, norms, grads = [], [], None
    for step, b in enumerate(batches(steps)):
        mine = [x[st.dp_rank * rows : (st.dp_rank + 1) * rows] for x in b]  # this replica's samples
        loss = loss_of(model, *mine)
        loss.backward()
        if step == 0 and kw.get("zero", 1) < 2:  # reduced gradients stay whole below ZeRO-2
            st.dp.finish_grad_sync()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        norms.append(float(meshspeed.clip_grad_norm_(model, CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(float(comm.all_reduce(loss.detach().reshape(1), mesh["dp"], "avg")))
    state = meshspeed.gather_for_save(model)
    return losses, norms, grads, (state if ctx.rank == 0 else None)


@pytest.mark.parametrize(
    "ws, dims, kw",
    [
        (2, dict(dp=2), dict(zero=1)),
        (2, dict(dp=2), dict(zero=2)),
        (2, dict(dp=2), dict(zero=3)),
        (3, dict(dp=3), dict(zero=3)),
        (2, dict(cp=2), dict(zero=1)),
        (2, dict(cp=2), dict(zero=1, cp_impl="ulysses")),
        (4, dict(dp=2, cp=2), dict(zero=3, cp_impl="hybrid", cp_ulysses=2)),
    ],
    ids=[
        "dp2-zero1",
        "dp2-zero2",
        "dp2-zero3",
        "dp3-zero3",
        "cp2-ring",
        "cp2-ulysses",
        "dp2-cp2-hybrid-zero3",
    ],
)
def test_diffusers_dit_loop_equals_one_process(ws, dims, kw):
    want_losses, want_norms, want_grads, want_state = one_process()
    results = harness.run(ws, job_loop, dims, kw, timeout=120)
    for losses, norms, grads, _ in results:
        assert max(abs(a - b) for a, b in zip(losses, want_losses)) < 1e-5, (losses, want_losses)
        assert max(abs(a - b) / b for a, b in zip(norms, want_norms)) < 1e-5, (norms, want_norms)
        if grads is not None:
            assert set(grads) == set(want_grads)
            for n, g in want_grads.items():
                err = (grads[n] - g).abs().max().item()
                assert err <= 1e-5 * max(1.0, g.abs().max().item()), f"gradient of {n} off by {err:.2e}"
    assert want_norms[0] > CLIP  # clipping was active, so its scale is checked too
    state = results[0][3]
    assert set(state) >= {n for n, _ in diffusers_model().named_parameters()}
    # A key bias's true gradient is 0 (softmax ignores what is added to every key): Adam turns
    # its rounding noise into lr-sized steps of either sign, so it is compared by gradient only.
    noise = {n for n, g in want_grads.items() if g.abs().max().item() < 1e-6}
    assert noise <= {f"transformer_blocks.{i}.attn1.to_k.bias" for i in range(2)}, noise
    for n, w in want_state.items():
        if n in state and n not in noise:  # non-persistent buffers are not saved
            err = (state[n] - w).abs().max().item()
            # AdamW turns a 1e-9 rounding difference of a ~0 gradient into ~1e-5 of weight
            assert err < 1e-4, f"{n} after {STEPS} steps off by {err:.2e}"


def job_refused(ctx):
    import meshspeed

    try:
        meshspeed.parallelize(torch.nn.Linear(4, 4), comm.ParallelDims(cp=2).build(ctx))
    except comm.ConfigError as e:
        return str(e)
    return None


def test_cp_on_another_model_is_one_line():
    msgs = harness.run(2, job_refused, timeout=60)
    assert all(
        m and "\n" not in m and "cp > 1 on Linear" in m and "DiTTransformer2DModel" in m for m in msgs
    ), msgs
