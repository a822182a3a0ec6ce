"""Fused linear cross-entropy (kernels.linear_ce) against the plain head: loss, d hidden and
d weight, float32 and bfloat16, the torch path and the Triton kernel (interpreter on CPU), one
process and vocab-parallel over tp 2.

Tolerances: float32 1e-5 relative (+1e-6 × the largest value); bfloat16 2e-2 relative (+2e-2 ×
the largest value): the logits and their gradient round at the same points as the plain head's,
but d weight sums bf16 products chunk by chunk (in float32) where the plain head makes one.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

from meshspeed import comm  # noqa: E402
from meshspeed.comm.placement import chunk_bounds  # noqa: E402
from meshspeed.kernels.linear_ce import (  # noqa: E402
    default_chunk,
    linear_cross_entropy,
    linear_cross_entropy_ref,
)
from tests import harness  # noqa: E402

TOL = {torch.float32: (1e-5, 1e-6), torch.bfloat16: (2e-2, 2e-2)}
ROWS, DIM, VOCAB = 26, 24, 40


def _data(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(2, ROWS // 2, DIM, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(VOCAB, DIM, generator=gen) * 0.3).to(DEVICE, dtype)
    t = torch.randint(0, VOCAB, (2, ROWS // 2), generator=gen).to(DEVICE)
    t[0, :4] = -100  # ignored positions count neither in the sum nor in the mean
    return h, w, t


def _run(fn, h, w, t, **kw):
    h, w = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    loss = fn(h, w, t, -100, **kw)
    (loss * 2.5).backward()  # the incoming gradient scales what the forward pass prepared
    return [loss.detach(), h.grad, w.grad]


def _close(got, want, dtype, what):
    rtol, atol = TOL[dtype]
    for name, a, b in zip(("loss", "d hidden", "d weight"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what} {name}"
        scale = max(1.0, b.float().abs().max().item())
        ok = torch.allclose(a.float(), b.float(), rtol=rtol, atol=atol * scale)
        assert ok, f"{what} {name}: max err {(a.float() - b.float()).abs().max().item()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("chunk", [0, 1, 7, 1000])  # Liger's size, one row, uneven, one chunk
def test_matches_plain_head(dtype, impl, chunk):
    if impl == "triton":
        pytest.importorskip("triton", reason="triton is in the dev extra: pip install -e .[dev]")
    h, w, t = _data(dtype)
    want = _run(linear_cross_entropy_ref, h, w, t)
    _close(_run(linear_cross_entropy, h, w, t, chunk=chunk, impl=impl), want, dtype, f"{impl} chunk {chunk}")


def test_without_grad_only_scores():
    h, w, t = _data(torch.float32)
    with torch.no_grad():
        got = linear_cross_entropy(h, w, t, chunk=5)
    assert torch.allclose(got, linear_cross_entropy_ref(h, w, t), rtol=1e-6)


def test_default_chunk_keeps_logits_near_hidden_size():
    assert default_chunk(8192, 4096, 128256) == 512  # 8192·4096/128256 = 261, up to a power of two
    assert default_chunk(10, 64, 32) == 10  # never more rows than there are
    assert default_chunk(10, 4, 4096) == 1


def test_bad_arguments_are_one_line():
    h, w, t = _data(torch.float32)
    with pytest.raises(ValueError, match="chunk=-1"):
        linear_cross_entropy(h, w, t, chunk=-1)
    with pytest.raises(ValueError, match="impl='cuda'"):
        linear_cross_entropy(h, w, t, impl="cuda")


def job_vocab_parallel(ctx) -> list[str]:
    """Every rank holds its torch.chunk slice of the vocabulary; hidden enters the region
    through copy_to (its backward sums the ranks' partial d hidden)."""
    group = comm.ParallelDims(tp=ctx.world.size).build(ctx)["tp"]
    h, w, t = _data(torch.float32, seed=1)
    want = _run(linear_cross_entropy_ref, h, w, t)
    lo, hi = chunk_bounds(VOCAB, group.size)[group.rank : group.rank + 2]
    hl, wl = h.clone().requires_grad_(True), w[lo:hi].clone().requires_grad_(True)
    loss = linear_cross_entropy(comm.copy_to(hl, group), wl, t, chunk=5, group=group, vocab_start=lo)
    (loss * 2.5).backward()
    bad = []
    for name, a, b in (
        ("loss", loss, want[0]),
        ("d hidden", hl.grad, want[1]),
        ("d weight", wl.grad, want[2][lo:hi]),
    ):
        if not torch.allclose(a.detach(), b, rtol=1e-5, atol=1e-6 * max(1.0, b.abs().max().item())):
            bad.append(f"rank {group.rank} {name}: max err {(a - b).abs().max().item()}")
    return bad


def test_vocab_parallel_tp2():
    assert harness.run(2, job_vocab_parallel) == [[], []]


def test_reference_is_the_plain_head():
    h, w, t = _data(torch.float32)
    plain = F.cross_entropy(F.linear(h, w).flatten(0, 1), t.flatten(), ignore_index=-100)
    assert torch.equal(linear_cross_entropy_ref(h, w, t), plain)
