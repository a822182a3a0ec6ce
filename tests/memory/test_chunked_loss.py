"""Chunked output projection + cross-entropy against the plain loss: value and gradients
(hidden states and output weight), tp 1 (plain loss) and tp 2, 3, 4 (vocab-parallel)."""

from __future__ import annotations

import pytest
import torch

from meshspeed import comm
from meshspeed.comm.placement import full_grad
from meshspeed.memory import chunked_loss, count_saved
from meshspeed.models import build_model, cross_entropy_loss, get_preset, recipe_for
from meshspeed.parallel.tensor import loss_fn, parallelize
from tests import harness

CONFIG = dict(dim=96, n_layers=1, n_heads=24, n_kv_heads=12, vocab_size=256, ffn_hidden=102, max_seq_len=32)
BATCH, SEQ = 2, 24


def _case(tp_group=None, chunk: int = 5):
    """(loss, d hidden, d output.weight) for the plain and the chunked loss on one model."""
    config = get_preset("tiny", **CONFIG)
    model = build_model(config, seed=3)
    if tp_group is not None:
        model = parallelize(model, tp_group, recipe_for(config))
    gen = torch.Generator().manual_seed(11)
    hidden = torch.randn(BATCH, SEQ, config.dim, generator=gen)
    targets = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=gen)
    targets[0, :7] = -100  # ignored positions, a whole first chunk of row 0 included
    targets[1, 20:] = -100
    fn = loss_fn(model, cross_entropy_loss)
    out = []
    for chunked in (False, True):
        h = hidden.clone().requires_grad_(True)
        model.zero_grad(set_to_none=True)
        with count_saved(model) as counted:
            loss = (
                chunked_loss(h, targets, model.output, fn, chunk) if chunked else fn(model.output(h), targets)
            )
        loss.backward()
        groups = {} if tp_group is None else {"tp": tp_group["tp"]}
        w = model.output.weight
        out.append((loss.detach(), h.grad, full_grad(w, groups) if groups else w.grad, counted.bytes))
    return out


def _mismatches(tp_group=None) -> list[str]:
    bad = []
    for chunk in (1, 5, 24, 100):
        (ref, dh, dw, plain_bytes), (got, gh, gw, chunk_bytes) = _case(tp_group, chunk)
        for what, a, b in (("loss", got, ref), ("d hidden", gh, dh), ("d output.weight", gw, dw)):
            scale = max(1.0, b.abs().max().item())
            if not torch.allclose(a, b, rtol=1e-5, atol=1e-6 * scale):
                bad.append(f"chunk {chunk}: {what} max err {(a - b).abs().max().item()}")
        if chunk < SEQ and not chunk_bytes < plain_bytes:  # the logits were not kept
            bad.append(f"chunk {chunk}: saved {chunk_bytes} B, plain {plain_bytes} B")
    return bad


def test_chunked_loss_single_device():
    assert _mismatches() == []


def job_tp(ctx) -> list[str]:
    return _mismatches(comm.ParallelDims(tp=ctx.world.size).build(ctx))


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_chunked_loss_vocab_parallel(tp):
    assert harness.run(tp, job_tp) == [[]] * tp


def test_chunked_loss_rejects_bad_chunk():
    with pytest.raises(ValueError, match="chunk=0"):
        chunked_loss(
            torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), torch.nn.Linear(3, 4), None, 0
        )
