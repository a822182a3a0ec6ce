"""What reaches cuSPARSELt at a pruned slot: +0.0, never -0.0.

w * mask writes -0.0 where a pruned weight is negative; an older cuSPARSELt counted -0.0 as a
nonzero, so torch._cslt_compress of such a matrix keeps the wrong positions (or sees three of
four kept), and the fused kernel's self-check, compared with that, fails. Every masked matrix
meshspeed hands to a compression is torch.where(mask, w, 0). On the CPU, cuSPARSELt is stood in
for by `older_cslt`: the sm90 layout (cslt_layout.compress_reference) keeping every slot whose
bits are not all zero, as that cuSPARSELt did; each stand-in also records the bits it was given."""

from __future__ import annotations

import pytest
import torch

from meshspeed.sparse import cslt_layout, cslt_ops, kernels
from meshspeed.sparse.cuda import CompressedWeight
from meshspeed.sparse.transposable import transposable_2to4_mask

SHAPE = (64, 64)


class OlderCslt:
    """torch._cslt_compress as an older cuSPARSELt: -0.0 counts as kept."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def __call__(self, wm: torch.Tensor) -> torch.Tensor:
        self.seen.append(wm.clone())
        return cslt_layout.compress_reference(wm, wm.view(torch.int16) != 0)


def _negative_weight() -> tuple[torch.Tensor, torch.Tensor]:
    """Every weight negative, so every pruned slot of w * mask would be -0.0."""
    torch.manual_seed(0)
    w = -(torch.rand(SHAPE) + 0.5)
    return w, transposable_2to4_mask(w)


def _assert_plus_zero_at_pruned(cslt: OlderCslt, w: torch.Tensor, mask: torch.Tensor) -> None:
    """Each matrix the stand-in got (W~, then W~^T) is +0.0 bits at pruned slots, w where kept."""
    assert cslt.seen, "the stand-in was never called"
    for wm, dense, m in zip(cslt.seen, (w, w.t()), (mask, mask.t())):
        bits = wm.view(torch.int16)
        assert (bits[~m] == 0).all(), f"{int((bits[~m] != 0).sum())} pruned slots are not +0.0 bits"
        assert torch.equal(wm[m], dense.to(wm.dtype)[m])


def test_w_times_mask_writes_minus_zero_the_reason_for_where():
    """The premise: the stand-in refuses what w * mask writes (three of four kept)."""
    w, mask = _negative_weight()
    assert (((w * mask).view(torch.int32)[~mask]) == -(2**31)).all()  # -0.0 bits
    with pytest.raises(ValueError, match="exactly 2 kept"):
        OlderCslt()((w * mask).to(torch.bfloat16))


def test_fallback_compression_hands_cusparselt_plus_zero():
    w, mask = _negative_weight()
    cslt = OlderCslt()
    got = cslt_ops.fallback_compress("cusparselt", w, mask, torch.bfloat16, True, True, cslt=cslt)
    _assert_plus_zero_at_pruned(cslt, w, mask)
    ref = kernels.mask_and_compress_reference(w, mask, dtype=torch.bfloat16)
    assert torch.equal(got.w.view(torch.uint8), ref.w.view(torch.uint8))
    assert torch.equal(got.wt.view(torch.uint8), ref.wt.view(torch.uint8))


def test_self_check_passes_against_a_cusparselt_that_counts_minus_zero(monkeypatch):
    """self_check's random matrix is half negative: with w * mask this cuSPARSELt refuses it and
    the fused kernel (interpreted here) would be reported as writing other bytes."""
    cslt = OlderCslt()
    monkeypatch.setattr(torch, "_cslt_compress", cslt, raising=False)
    assert cslt_ops.self_check(SHAPE, torch.bfloat16, torch.device("cpu")) == ""
    w, mask = cslt_ops._random_24(SHAPE, torch.bfloat16, torch.device("cpu"))
    assert (w < 0).any()
    assert len(cslt.seen) == 2
    _assert_plus_zero_at_pruned(cslt, w, mask)


def test_the_compressed_weight_cache_hands_the_compression_plus_zero():
    w, mask = _negative_weight()
    cslt = OlderCslt()
    cache = CompressedWeight(compress=cslt)
    cache.get(w, mask, 0, torch.bfloat16, True)
    assert len(cslt.seen) == 2
    _assert_plus_zero_at_pruned(cslt, w, mask)
