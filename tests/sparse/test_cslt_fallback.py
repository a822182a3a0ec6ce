"""The compression fallback of CsltOps (for shapes where the fused Triton kernel does not write
cuSPARSELt's bytes): the plain-torch layout is taken only when it writes the bytes
torch._cslt_compress writes on this device and was faster, chosen once per shape. On the CPU,
cuSPARSELt is stood in for by functions with its contract (a compressed 1-D tensor of the
masked matrix): one writing the sm90 layout (which tests/sparse/test_cslt_fixture.py shows is
cuSPARSELt's own on an H200) and one writing other bytes; timings are scripted."""

from __future__ import annotations

import warnings

import pytest
import torch

from meshspeed.sparse import cslt_layout, cslt_ops, kernels


def sm90(wm: torch.Tensor) -> torch.Tensor:
    """cuSPARSELt's compress of a masked matrix with no zero among its kept values."""
    return cslt_layout.compress_reference(wm, wm != 0)


def other_layout(wm: torch.Tensor) -> torch.Tensor:
    """Another architecture's order: the same bytes, metadata reversed."""
    out = sm90(wm)
    half = wm.numel() // 2
    out[half:] = out[half:].flip(0)
    return out


def timed(ref_ms: float, cslt_ms: float):
    """A time_ms that says the reference took ref_ms and cuSPARSELt cslt_ms (in call order)."""
    answers = iter([ref_ms, cslt_ms])
    return lambda fn, device: (fn(), next(answers))[1]


SHAPE, CPU = (128, 256), torch.device("cpu")


@pytest.mark.parametrize("ref_ms, cslt_ms, want", [(2.0, 40.0, "reference"), (40.0, 2.0, "cusparselt")])
def test_the_faster_of_two_equal_layouts_is_chosen(ref_ms, cslt_ms, want):
    got = cslt_ops.choose_fallback(SHAPE, torch.bfloat16, CPU, cslt=sm90, time_ms=timed(ref_ms, cslt_ms))
    assert got == want


def test_a_layout_that_differs_here_is_never_taken_however_fast():
    got = cslt_ops.choose_fallback(SHAPE, torch.bfloat16, CPU, cslt=other_layout, time_ms=timed(0.1, 99.0))
    assert got == "cusparselt"


def test_a_shape_off_the_64_grid_goes_to_cusparselt():
    assert cslt_ops.choose_fallback((96, 128), torch.bfloat16, CPU, cslt=sm90, time_ms=timed(0.1, 9.0)) == (
        "cusparselt"
    )


@pytest.mark.parametrize("path", ["reference", "cusparselt"])
def test_both_paths_compress_w_and_its_transpose_as_the_oracle(path):
    w, mask = cslt_ops._random_24(SHAPE, torch.float32, CPU)
    got = cslt_ops.fallback_compress(path, w, mask, torch.bfloat16, True, True, cslt=sm90)
    want = kernels.mask_and_compress_reference(w, mask, dtype=torch.bfloat16)
    assert torch.equal(got.w.view(torch.uint8), want.w.view(torch.uint8))
    assert torch.equal(got.wt.view(torch.uint8), want.wt.view(torch.uint8))


def test_csltops_compresses_through_the_chosen_fallback_once_per_shape(monkeypatch):
    """CsltOps where the fused kernel's self-check fails (the fault injected: what the compiled
    kernel did on an H200): the fallback is chosen once for the shape, and its bytes are the
    oracle's."""
    monkeypatch.setattr(torch, "_cslt_compress", sm90, raising=False)
    # the kernel is there (whether or not Triton is installed here: the fused kernel never runs)
    # but its self-check fails
    monkeypatch.setattr(cslt_ops.kernels, "available", lambda: True)
    monkeypatch.setattr(cslt_ops, "self_check", lambda *a: "W: planted mismatch")
    chosen = []
    real = cslt_ops.choose_fallback
    monkeypatch.setattr(cslt_ops, "choose_fallback", lambda *a: chosen.append(a) or real(*a))
    ops = cslt_ops.CsltOps()
    w, mask = cslt_ops._random_24(SHAPE, torch.float32, CPU)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "compression through torch._cslt_compress: ..."
        got = ops.compress(w, mask, torch.bfloat16)
        ops.compress(w, mask, torch.bfloat16)
    assert ops.fused_misfit[(SHAPE, torch.bfloat16, CPU)] == "W: planted mismatch"
    assert len(chosen) == 1 and list(ops.fallback.values()) in (["reference"], ["cusparselt"])
    want = kernels.mask_and_compress_reference(w, mask, dtype=torch.bfloat16)
    assert torch.equal(got.w.view(torch.uint8), want.w.view(torch.uint8))
