"""`meshspeed.parallelize` on a `transformers` Qwen2VLForConditionalGeneration (issue 43, item 4):
tp on its language decoder (the Qwen2 plan), dp on its vision encoder. A user's own loop (forward
with pixel_values + image_grid_thw + input_ids, the labels= loss, backward, AdamW) at tp 2 and at
dp 2 gives the one-process loop's losses and, at the first step, every gradient (tp shards
gathered) within 1e-4 of its tensor's largest element. The encoder stays whole on every rank; cp, pp and
sequence parallelism are refused in one line."""

from __future__ import annotations

import functools
import importlib.util
import math

import pytest
import torch

from meshspeed import comm
from tests import harness

needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")

BATCH, STEPS, LR, EPS = 4, 2, 1e-3, 1e-6  # EPS: see test_parallelize.py
TOL = 1e-5  # the losses
REL = 1e-4  # each gradient tensor: its largest difference over its largest element


def model_and_batch():
    """The tiny random Qwen2-VL of test_hf_vlm.py and a batch: 4 samples, each with one image."""
    from tests.interop.test_hf_vlm import CONFIG, IMG, hf_model, inputs

    model = hf_model(CONFIG, seed=0)  # every weight drawn N(0, 0.2): a loss of 5.6 nats
    tokens, _, pixel_values = inputs(BATCH)
    labels = tokens.masked_fill(tokens == IMG, -100)
    grid = torch.tensor([[1, 4, 4]] * BATCH)
    return model, (tokens, pixel_values, grid, labels, IMG)


def loss_of(model, batch, rows: slice):
    tokens, pixel_values, grid, labels, img = batch
    per = pixel_values.shape[0] // tokens.shape[0]  # patches per image (one image a sample)
    pv = pixel_values[rows.start * per : rows.stop * per]
    x = tokens[rows]
    return model(
        input_ids=x,
        pixel_values=pv,
        image_grid_thw=grid[rows],
        mm_token_type_ids=(x == img).int(),
        labels=labels[rows],
    ).loss


@functools.cache
def one_process():
    """The loop without meshspeed: (losses, gradient norms, step-0 gradients)."""
    model, batch = model_and_batch()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses, norms, grads = [], [], None
    for step in range(STEPS):
        loss = loss_of(model, batch, slice(0, BATCH))
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, grads


def job_loop(ctx, dims: dict, kw: dict):
    import meshspeed
    from meshspeed.comm import placement

    model, batch = model_and_batch()
    mesh = comm.ParallelDims(**dims).build(ctx)
    model, opt = meshspeed.parallelize(model, mesh, lr=LR, eps=EPS, **kw)
    st = model.meshspeed
    rows = BATCH // st.dp_size
    mine = slice(st.dp_rank * rows, (st.dp_rank + 1) * rows)  # this replica's samples
    split = sorted(n for n, p in model.named_parameters() if placement.sharding_of(p) is not None)
    losses, norms, grads = [], [], None
    for step in range(STEPS):
        loss = loss_of(model, batch, mine)
        loss.backward()
        if step == 0 and kw["zero"] < 2:
            st.dp.finish_grad_sync()  # ZeRO-1: the reduced gradients are whole in p.grad
            grads = {
                n: placement.full_tensor(p.grad, mesh, placement.sharding_of(p)).clone()
                for n, p in model.named_parameters()
            }
        norms.append(float(meshspeed.clip_grad_norm_(model)))  # the whole model's, every rank
        opt.step()
        opt.zero_grad()
        losses.append(float(comm.all_reduce(loss.detach().reshape(1), mesh["dp"], "avg")))
    return losses, norms, grads, split


@needs_hf
@pytest.mark.parametrize(
    "dims, zero",
    [
        pytest.param(dict(tp=2), 1, id="tp2"),
        pytest.param(dict(dp=2), 1, id="dp2"),
        pytest.param(dict(dp=2), 3, id="dp2-zero3"),  # gradients sharded: norms and losses only
    ],
)
def test_qwen2vl_loop_equals_one_process(dims, zero):
    want_losses, want_norms, want_grads = one_process()
    results = harness.run(2, job_loop, dims, dict(zero=zero), timeout=120)
    for losses, norms, grads, split in results:
        if grads is not None:
            assert sorted(grads) == sorted(want_grads)
            rel = {n: ((grads[n] - g).abs().max() / g.abs().max()).item() for n, g in want_grads.items()}
            assert max(rel.values()) < REL, sorted(rel.items(), key=lambda kv: -kv[1])[:3]
        assert max(abs(a - b) for a, b in zip(norms, want_norms)) < TOL, (norms, want_norms)
        assert max(abs(a - b) for a, b in zip(losses, want_losses)) < TOL, (losses, want_losses)
        assert not any(".visual." in n for n in split), split  # the encoder is data parallel
        if "tp" in dims:  # the decoder and the head are split
            assert "lm_head.weight" in split and any(".language_model.layers.0.mlp." in n for n in split)
    enc = [g for n, g in want_grads.items() if ".visual." in n]
    assert enc and min(g.abs().max() for g in enc) > 1e-4  # every encoder gradient is live


@needs_hf
@pytest.mark.parametrize(
    "dims, kw, what",
    [
        (dict(tp=2), dict(sequence_parallel=True), "sequence_parallel=True"),
        (dict(cp=2), {}, "cp=2"),
        (dict(pp=2), {}, "pp=2"),
    ],
)
def test_unsupported_options_are_one_line(dims, kw, what):
    import meshspeed

    model, _ = model_and_batch()
    with pytest.raises(comm.ConfigError) as e:  # refused before any group is built
        meshspeed.parallelize(model, comm.ParallelDims(**dims), **kw)
    msg = str(e.value)
    assert "\n" not in msg and what in msg and "Qwen2VLForConditionalGeneration" in msg, msg
    assert not hasattr(model, "meshspeed")
