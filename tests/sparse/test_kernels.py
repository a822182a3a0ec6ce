"""The fused transposable-2:4 mask + compression kernel against the plain-torch references, bit for
bit: on CPU through Triton's interpreter (what TRITON_INTERPRET=1 selects; kernels.py picks it
for CPU tensors with or without the variable), on CUDA against torch._cslt_compress itself."""

import pytest
import torch

from meshspeed.sparse import cslt_layout, kernels, nm_mask, transposable_2to4_mask
from meshspeed.sparse.transposable import PATTERN_PAIRS, ROW_PAIRS, transposable_patterns

needs_triton = pytest.mark.skipif(not kernels.available(), reason="Triton is not installed")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _assert_same(got: kernels.Sparse24, ref: kernels.Sparse24) -> None:
    assert torch.equal(got.mask, ref.mask), "mask differs from transposable_2to4_mask"
    for what, a, b in (("W", got.w, ref.w), ("W^T", got.wt, ref.wt)):
        if b is None:
            assert a is None
            continue
        diff = (_bytes(a) != _bytes(b)).nonzero()
        assert diff.numel() == 0, f"compressed {what} differs at bytes {diff[:8].flatten().tolist()}"


# ---- the layout reference ------------------------------------------------------------------------


def test_pattern_table_is_the_90_blocks_in_order():
    assert len(PATTERN_PAIRS) == 90
    pats = transposable_patterns().reshape(-1, 4, 4)
    for k, combo in enumerate(PATTERN_PAIRS):
        for r, p in enumerate(combo):
            assert pats[k, r].nonzero().flatten().tolist() == list(ROW_PAIRS[p])


def test_metadata_offsets_cover_every_byte_once():
    idx = cslt_layout.meta_index(128, 192).flatten()
    assert torch.equal(idx.sort().values, torch.arange(128 * 192 // 8))


def _lane_simulation(nib: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """torchao's sm90 cuSPARSELt metadata store, lane by lane: 64x64 blocks, two warps; each
    lane holds the bytes of 16 columns of one row, swaps nibbles with lane ^ 16 (rows r, r + 8)
    and bytes with lane ^ 1, and stores 16 bits. An independent derivation of the formula."""
    out = torch.zeros(rows * cols // 8, dtype=torch.uint8)

    def byte(r, b):  # 8 columns: low nibble the left group
        return int(nib[r, 2 * b]) | int(nib[r, 2 * b + 1]) << 4

    def lane16(r, c):  # what a lane loads: 16 columns of row r from column c
        return byte(r, c // 8) | byte(r, c // 8 + 1) << 8

    for br in range(0, rows, 64):
        for bc in range(0, cols, 64):
            for col in (bc, bc + 32):
                for row in range(br, br + 64, 16):
                    s0 = [lane16(row + ln // 2, col + 16 * (ln % 2)) for ln in range(32)]
                    s1 = [
                        (s0[ln] & 0xF0F0) | ((s0[ln ^ 16] >> 4) & 0x0F0F)
                        if ln & 16
                        else (s0[ln] & 0x0F0F) | ((s0[ln ^ 16] << 4) & 0xF0F0)
                        for ln in range(32)
                    ]
                    base = (col // 32) * 256 + ((row % 64) // 16) * 64 + (row // 64) * 8 * cols
                    for ln in range(32):
                        mine, other = s1[ln], s1[ln ^ 1]
                        v = (mine & 0xFF00) | other >> 8 if ln & 1 else (mine & 0xFF) | (other << 8) & 0xFF00
                        at = base + (ln % 2) * 4 + ((ln % 16) // 2) * 8 + (ln // 16) * 2
                        out[at], out[at + 1] = v & 0xFF, v >> 8
    return out


@pytest.mark.parametrize("shape", [(64, 64), (128, 192)])
def test_reference_layout_matches_the_lane_level_store_and_round_trips(shape):
    torch.manual_seed(0)
    w = torch.randn(shape, dtype=torch.bfloat16)
    mask = nm_mask(w, 2, 4)
    packed = cslt_layout.compress_reference(w, mask)
    assert packed.numel() == shape[0] * shape[1] * 9 // 16
    values, meta = cslt_layout.split(packed, *shape)
    assert torch.equal(values.flatten(), w[mask])
    m4 = mask.reshape(shape[0], -1, 4)
    lo = torch.where(m4, torch.arange(4), 4).amin(-1)
    hi = torch.where(m4, torch.arange(4), -1).amax(-1)
    assert torch.equal(meta, _lane_simulation(lo | hi << 2, *shape))
    assert torch.equal(cslt_layout.decompress_reference(packed, *shape), w * mask)


def test_reference_refuses_what_it_cannot_lay_out():
    w = torch.randn(64, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiples of 64"):
        cslt_layout.compress_reference(torch.randn(64, 96), torch.ones(64, 96, dtype=torch.bool))
    with pytest.raises(ValueError, match="exactly 2 kept"):
        cslt_layout.compress_reference(w, torch.ones(64, 64, dtype=torch.bool))
    with pytest.raises(ValueError, match="bf16/fp16"):
        kernels.mask_and_compress(w.float(), dtype=torch.float32)


# ---- the Triton kernel, interpreted on CPU -------------------------------------------------------


@needs_triton
@pytest.mark.parametrize(
    "wdtype,dtype",
    [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)],
)
def test_kernel_mask_and_compression_equal_the_references(wdtype, dtype):
    """Mask from |W| (an update step): one program over a 64x128 weight."""
    torch.manual_seed(1)
    w = torch.randn(64, 128, dtype=wdtype)
    got = kernels.mask_and_compress(w, dtype=dtype)
    ref = kernels.mask_and_compress_reference(w, dtype=dtype)
    assert torch.equal(ref.mask, transposable_2to4_mask(w))
    _assert_same(got, ref)


@needs_triton
def test_kernel_ties_and_nan_pick_what_argmax_picks():
    """Small integers tie everywhere (the first pattern must win), a NaN ranks highest."""
    torch.manual_seed(2)
    w = torch.randint(-2, 3, (64, 64)).to(torch.bfloat16)
    w[5, 7] = float("nan")
    w[40:44, 8:12] = 1.0  # a block of equal values: all 90 patterns tie
    got = kernels.mask_and_compress(w, want_w=False, want_t=False)
    assert got.w is None and got.wt is None
    assert torch.equal(got.mask, transposable_2to4_mask(w))
    assert got.mask[5, 7]


@needs_triton
def test_kernel_with_a_given_mask_over_several_programs():
    """The per-step compression (mask given, W fp32 masters -> bf16) on a 2 x 2 grid of programs,
    and W alone for a row-only 2:4 mask (no W^T)."""
    torch.manual_seed(3)
    w = torch.randn(128, 128)
    mask = transposable_2to4_mask(torch.randn(128, 128))  # not |W|'s own: the mask is an input
    got = kernels.mask_and_compress(w, mask, dtype=torch.bfloat16, tile=(4, 64))
    _assert_same(got, kernels.mask_and_compress_reference(w, mask, dtype=torch.bfloat16))
    w = w[:64, :64]
    rows_only = nm_mask(w, 2, 4)
    got = kernels.mask_and_compress(w, rows_only, dtype=torch.bfloat16, want_t=False)
    _assert_same(got, kernels.mask_and_compress_reference(w, rows_only, dtype=torch.bfloat16, want_t=False))


@needs_triton
@pytest.mark.slow
@pytest.mark.parametrize("compute_mask", [True, False])
def test_kernel_compiles_for_hopper(compute_mask):
    """The interpreter runs Python; this compiles the same source to a Hopper cubin (ptxas ships
    with Triton), so a construct only the interpreter accepts fails here, without a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from meshspeed.sparse.sparse24_triton import sparse24_kernel

    sig = dict(w_ptr="*fp32", stride_w="i32", m_ptr="*u8", tab_ptr="*i32", vals_ptr="*bf16", meta_ptr="*u8")
    sig.update(valst_ptr="*bf16", metat_ptr="*u8", R="i32", C="i32")
    consts = dict(COMPUTE_MASK=compute_mask, DO_W=True, DO_T=True, TG=4, TC=128)
    sig.update({k: "constexpr" for k in consts})
    src = ASTSource(fn=triton.jit(sparse24_kernel), signature=sig, constexprs=consts)
    options = {"num_warps": 4, "enable_fp_fusion": False}
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    assert out.asm["cubin"]


# ---- on CUDA: against cuSPARSELt's own compression -----------------------------------------------

needs_cslt = pytest.mark.skipif(
    not torch.cuda.is_available() or not torch.backends.cusparselt.is_available(),
    reason="needs a CUDA GPU and a torch build with cuSPARSELt",
)


@needs_cslt
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_kernel_equals_cslt_compress(dtype):
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the kernel writes the sm90 layout; older GPUs compress through _cslt_compress")
    torch.manual_seed(4)
    w = torch.randn(256, 512, device="cuda")
    w = torch.where(w.abs() < 1e-3, 1.0, w)  # no zero at a kept position: positions are the mask's
    got = kernels.mask_and_compress(w, dtype=dtype)
    ref = kernels.mask_and_compress_reference(w.cpu(), dtype=dtype)
    assert torch.equal(got.mask.cpu(), ref.mask)  # the mask, bit for bit, on the GPU too
    wm = w.to(dtype) * got.mask
    assert torch.equal(_bytes(got.w), _bytes(torch._cslt_compress(wm)))
    assert torch.equal(_bytes(got.wt), _bytes(torch._cslt_compress(wm.t().contiguous())))
    assert torch.equal(_bytes(got.w).cpu(), _bytes(ref.w))  # and the torch reference is that layout


@needs_cslt
def test_cuda_self_check_passes_on_hopper():
    from meshspeed.sparse.cslt_ops import self_check

    why = self_check((128, 256), torch.bfloat16, torch.device("cuda"))
    if torch.cuda.get_device_capability() >= (9, 0):
        assert why == ""
    else:
        assert why  # another layout: found, so compression falls back to _cslt_compress
