"""meshspeed's compressed 2:4 layout against cuSPARSELt's own bytes, on the CPU.

fixtures/cslt_h200.pt holds what torch._cslt_compress wrote on an NVIDIA H200 (torch 2.11,
CUDA 13; benchmarks/cslt_capture.py made it) for matrices whose kept values are all distinct
(benchmarks.cslt_capture.coded regenerates them). The torch reference of the layout
(cslt_layout.compress_reference) and the fused Triton kernel, through its interpreter, must
write the same bytes: values and metadata, for W and for W^T. The fixture holds one direction
only, so the kernel's W^T is checked by handing it the fixture's matrix transposed: its W^T is
then the fixture's W (the W^T metadata pairs columns c and c + 8, another code path than W's
rows r and r + 8)."""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks.cslt_capture import coded
from meshspeed.sparse import cslt_layout, kernels

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "cslt_h200.pt")
CASES = torch.load(FIXTURE)["cases"]


def _case(key: str):
    dtype, shape, seed = key.split("_")
    rows, cols = map(int, shape.split("x"))
    dense = coded(rows, cols, int(seed.removeprefix("seed"))).to(getattr(torch, dtype))
    return dense, CASES[key].reshape(-1)  # stored as cuSPARSELt returned it: [rows, bytes per row]


def _assert_bytes(key: str, what: str, got: torch.Tensor, want: torch.Tensor, half: int) -> None:
    got = got.view(torch.uint8)
    assert torch.equal(got[:half], want[:half]), f"{key} {what}: the values differ"
    bad = (got[half:] != want[half:]).nonzero().flatten()
    assert not len(bad), f"{key} {what}: {len(bad)} metadata bytes differ, first at byte {int(bad[0])}"


@pytest.mark.parametrize("key", sorted(CASES))
def test_the_reference_layout_is_cusparselts_byte_for_byte(key):
    dense, want = _case(key)
    got = cslt_layout.compress_reference(dense, dense != 0)
    _assert_bytes(key, "W", got, want, dense.numel() * dense.element_size() // 2)


@pytest.mark.parametrize("key", sorted(CASES))
def test_the_triton_kernel_writes_cusparselts_bytes_in_the_interpreter(key, monkeypatch):
    """W from the fixture's matrix, W^T from its transpose (fp32 in, rounded by the kernel);
    the half of the kernel that is not asked for is never run on a mask that is 2:4 only one way."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    dense, want = _case(key)
    half = dense.numel() * dense.element_size() // 2  # the kept values' bytes, then the metadata
    got = kernels.mask_and_compress(dense.float(), dense != 0, dtype=dense.dtype, want_t=False)
    _assert_bytes(key, "W", got.w, want, half)
    dt = dense.t().contiguous()
    got = kernels.mask_and_compress(dt.float(), dt != 0, dtype=dense.dtype, want_w=False)
    _assert_bytes(key, "W^T", got.wt, want, half)
