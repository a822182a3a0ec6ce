"""Chunked output projection + cross-entropy against the plain loss: value and gradients
(hidden states and output weight), tp 1 (plain loss) and tp 2, 3, 4 (vocab-parallel), both ways:
fused (kernels.linear_ce: gradients formed in the forward pass) and checkpointed (logits
recomputed in backward). Neither keeps the [tokens, vocab] logits: the checkpointed one keeps
the chunks' inputs, the fused one d hidden and d weight only."""

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
BATCH, SEQ = 4, 48  # more tokens than dim: d weight [vocab, dim] is less than the logits
IMPLS = ("torch", "checkpoint")


def _case(tp_group=None, chunk: int = 5, impl: str = "torch"):
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
                chunked_loss(h, targets, model.output, fn, chunk, impl=impl)
                if chunked
                else fn(model.output(h), targets)
            )
        loss.backward()
        groups = {} if tp_group is None else {"tp": tp_group["tp"]}
        w = model.output.weight
        dw = full_grad(w, groups) if groups else w.grad
        out.append((loss.detach(), h.grad, dw, counted.bytes, w.numel()))
    return out


def _mismatches(tp_group=None) -> list[str]:
    bad = []
    for impl in IMPLS:
        for chunk in (1, 5, 24, 100):
            (ref, dh, dw, plain_bytes, _), (got, gh, gw, chunk_bytes, w_local) = _case(tp_group, chunk, impl)
            for what, a, b in (("loss", got, ref), ("d hidden", gh, dh), ("d output.weight", gw, dw)):
                scale = max(1.0, b.abs().max().item())
                if not torch.allclose(a, b, rtol=1e-5, atol=1e-6 * scale):
                    bad.append(f"{impl} chunk {chunk}: {what} max err {(a - b).abs().max().item()}")
            # the logits were not kept: less than the plain head; fused, exactly d hidden + d weight
            if (chunk < SEQ or impl != "checkpoint") and not chunk_bytes < plain_bytes:
                bad.append(f"{impl} chunk {chunk}: saved {chunk_bytes} B, plain {plain_bytes} B")
            if impl != "checkpoint" and chunk_bytes != 4 * (BATCH * SEQ * dw.shape[1] + w_local):
                bad.append(f"{impl} chunk {chunk}: saved {chunk_bytes} B, not d hidden + d weight")
    return bad


def test_chunked_loss_single_device():
    assert _mismatches() == []


def job_tp(ctx) -> list[str]:
    return _mismatches(comm.ParallelDims(tp=ctx.world.size).build(ctx))


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_chunked_loss_vocab_parallel(tp):
    assert harness.run(tp, job_tp) == [[]] * tp


def test_chunked_loss_rejects_bad_chunk():
    for chunk, impl in ((0, "checkpoint"), (-1, "torch")):
        with pytest.raises(ValueError, match=f"chunk={chunk}"):
            chunked_loss(
                torch.zeros(1, 2, 3),
                torch.zeros(1, 2, dtype=torch.long),
                torch.nn.Linear(3, 4),
                None,
                chunk,
                impl=impl,
            )


def test_unknown_head_falls_back_to_checkpointed_chunks():
    # a head with a bias is not one the fused loss computes: the checkpointed path scores it
    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(6, 10)
    h, t = torch.randn(2, 8, 6, generator=gen), torch.randint(0, 10, (2, 8), generator=gen)
    want = cross_entropy_loss(head(h), t)
    got = chunked_loss(h, t, head, cross_entropy_loss, 3)
    assert torch.allclose(got, want, rtol=1e-6)
