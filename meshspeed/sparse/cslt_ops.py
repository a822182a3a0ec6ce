"""The cuSPARSELt products a 2:4 layer runs, and a plain-torch stand-in with the same contract.

Contract (what SparseLinear calls; CsltOps is torch's low-level cuSPARSELt ops):

    ops.compress(weight, mask, dtype, want_w=, want_t=) -> kernels.Sparse24 (W~ and/or W~^T)
    ops.mm(compressed_A, dense_B, bias, alg_id)  -> (A @ dense_B + bias[:, None])^T, contiguous
    ops.search(compressed_A, dense_B, bias)      -> the fastest alg_id for that product shape
    ops.accepts(dense_B)                         -> whether mm can take that operand

A is [m, k] compressed, dense_B [k, n]. The layer passes x^T and dY^T (views of the contiguous
activations: cuSPARSELt reads a transposed operand in place) and takes the transposed result, so
y = x W~^T and dX = dY W~ come out [tokens, features] with no transpose or copy on the path.

Compression goes through the fused Triton kernel (kernels.py) once it has matched
torch._cslt_compress byte for byte at that shape on this GPU (one check per shape and dtype).
Otherwise (another architecture's layout, a shape off the 64 grid, no Triton, or a compiled
kernel that writes other bytes: seen on an H200 with triton 3.6) the fallback is chosen once per
shape by measurement: the same layout in plain torch (cslt_layout.compress_reference, a few
elementwise passes), when it too matches torch._cslt_compress byte for byte here, or
torch._cslt_compress itself (30-117 ms a matrix at 8B/70B MLP shapes on the H200), whichever
compressed W and W^T faster; each once for W~ and once for W~^T, off the product path.

ReferenceCsltOps implements the contract on any device in plain torch (decompress, then a dense
matmul) so the sparse path's wiring is tested on CPU.
"""

from __future__ import annotations

import warnings

import torch

from meshspeed.sparse import choice, cslt_layout, kernels
from meshspeed.sparse.transposable import transposable_2to4_mask


def _check_operand(dense_b: torch.Tensor) -> bool:
    # cuSPARSELt takes a row-major operand or the transpose of one, 16-byte aligned, n % 8 == 0
    if dense_b.dim() != 2 or dense_b.shape[1] % 8 or dense_b.shape[0] % 8:
        return False
    if not (dense_b.is_contiguous() or dense_b.t().is_contiguous()):
        return False
    return dense_b.data_ptr() % 16 == 0


class CsltOps:
    """torch._cslt_sparse_mm with the algorithm searched once per product shape."""

    name = "cusparselt"

    def __init__(self) -> None:
        self.fused_misfit: dict[tuple, str] = {}  # (shape, dtype, device) -> why not fused ('' = fused)
        self.fallback: dict[tuple, str] = {}  # (shape, dtype, device) -> "reference" | "cusparselt"

    @staticmethod
    def runs_on(device: torch.device) -> bool:
        return device.type == "cuda"

    @staticmethod
    def capability(device: torch.device) -> tuple[int, int] | None:
        if device.type != "cuda" or not torch.cuda.is_available():
            return None
        return tuple(torch.cuda.get_device_capability(device))

    def why_not_fused(self, shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> str:
        """'' when the Triton kernel writes what _cslt_compress writes at this shape here, else why not."""
        key = (tuple(shape), dtype, device)
        if key not in self.fused_misfit:
            why = cslt_layout.misfit(*shape) or ("" if kernels.available() else "Triton is not installed")
            if not why:
                why = self_check(shape, dtype, device)
            if why:
                warnings.warn(f"2:4 compression at {shape[0]}x{shape[1]} through torch._cslt_compress: {why}")
            self.fused_misfit[key] = why
        return self.fused_misfit[key]

    def compress(self, weight, mask, dtype, *, want_w: bool = True, want_t: bool = True) -> kernels.Sparse24:
        if not self.why_not_fused(tuple(weight.shape), dtype, weight.device):
            return kernels.mask_and_compress(weight, mask, dtype=dtype, want_w=want_w, want_t=want_t)
        mask = transposable_2to4_mask(weight) if mask is None else mask
        key = (tuple(weight.shape), dtype, weight.device)
        if key not in self.fallback:
            self.fallback[key] = choose_fallback(tuple(weight.shape), dtype, weight.device)
        return fallback_compress(self.fallback[key], weight, mask, dtype, want_w, want_t)

    @staticmethod
    def accepts(dense_b: torch.Tensor) -> bool:
        return _check_operand(dense_b)

    @staticmethod
    def mm(compressed, dense_b, bias, alg_id: int) -> torch.Tensor:
        return torch._cslt_sparse_mm(compressed, dense_b, bias=bias, transpose_result=True, alg_id=alg_id)

    @staticmethod
    def search(compressed, dense_b, bias) -> int:
        return int(torch._cslt_sparse_mm_search(compressed, dense_b, bias=bias, transpose_result=True))


def self_check(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> str:
    """Compress a random transposable 2:4 matrix with the Triton kernel and with
    torch._cslt_compress: '' when W and W^T match byte for byte, else what differed. Random
    values are never zero, so cuSPARSELt sees exactly the mask's positions."""
    try:
        w, mask = _random_24(shape, dtype, device)
        mine = kernels.mask_and_compress(w, mask, dtype=dtype)
        wm = torch.where(mask, w, 0)  # +0.0 at pruned slots (w * mask writes -0.0 where w < 0)
        ref_w, ref_t = torch._cslt_compress(wm), torch._cslt_compress(wm.t().contiguous())
    except Exception as err:  # any failure means: compress through cuSPARSELt instead
        return f"the fused kernel could not be checked ({type(err).__name__}: {err})"
    for what, a, b in (("W", mine.w, ref_w), ("W^T", mine.wt, ref_t)):
        if a.numel() != b.numel():
            return f"{what}: cuSPARSELt's compressed size {b.numel()} differs from {a.numel()}"
        if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
            return f"{what}: this GPU's cuSPARSELt layout differs from the sm90 one the kernel writes"
    return ""


def fallback_compress(path: str, weight, mask, dtype, want_w: bool, want_t: bool, cslt=None):
    """W~ and W~^T of weight under `mask` through `path`: "reference" (the layout in plain torch)
    or "cusparselt" (torch._cslt_compress; `cslt` stands in for it in tests)."""
    wm = torch.where(mask.bool(), weight.detach().to(dtype), 0)  # +0.0 pruned: never -0.0 (w * mask)
    if path == "reference":
        maskb = mask.bool()
        w = cslt_layout.compress_reference(wm, maskb) if want_w else None
        wt = cslt_layout.compress_reference(wm.t().contiguous(), maskb.t().contiguous()) if want_t else None
        return kernels.Sparse24(w, wt, mask)
    cslt = cslt or torch._cslt_compress
    w = cslt(wm) if want_w else None
    wt = cslt(wm.t().contiguous()) if want_t else None
    return kernels.Sparse24(w, wt, mask)


def _time_ms(fn, device: torch.device) -> float:
    """Median ms of fn() (choice.time_ms: CUDA events on a GPU, the wall clock elsewhere)."""
    return choice.time_ms("compress", fn, device, iters=3, warmup=1)


def choose_fallback(
    shape: tuple[int, int], dtype: torch.dtype, device: torch.device, cslt=None, time_ms=_time_ms
) -> str:
    """The faster correct fallback for this shape: "reference" when compress_reference writes
    the bytes torch._cslt_compress writes here (W and W^T of a random transposable 2:4 matrix)
    and compressed both in less time, else "cusparselt". `cslt` and `time_ms` are injectable
    (tests: a stand-in layout, scripted timings)."""
    if cslt_layout.misfit(*shape):
        return "cusparselt"  # the reference layout needs whole 64-row bands
    try:
        w, mask = _random_24(shape, dtype, device)
        ref = fallback_compress("reference", w, mask, dtype, True, True)
        theirs = fallback_compress("cusparselt", w, mask, dtype, True, True, cslt)
    except Exception:  # noqa: BLE001 - any failure: cuSPARSELt's own compression
        return "cusparselt"
    for a, b in ((ref.w, theirs.w), (ref.wt, theirs.wt)):
        if a.numel() != b.numel() or not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
            return "cusparselt"
    t_ref = time_ms(lambda: fallback_compress("reference", w, mask, dtype, True, True), device)
    t_cslt = time_ms(lambda: fallback_compress("cusparselt", w, mask, dtype, True, True, cslt), device)
    return "reference" if t_ref < t_cslt else "cusparselt"


def _random_24(shape, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded random matrix with no zero (so cuSPARSELt keeps exactly the mask's positions) and
    its transposable 2:4 mask."""
    g = torch.Generator(device=device).manual_seed(0)
    w = torch.rand(shape, generator=g, device=device) + 0.5
    w = torch.where(torch.rand(shape, generator=g, device=device) < 0.5, -w, w).to(dtype)
    return w, transposable_2to4_mask(w)


class ReferenceCsltOps:
    """The contract in plain torch on any device (CPU tests). `fused=True` compresses through
    the Triton kernel (the interpreter on CPU: slow), else through the torch reference."""

    name = "reference"

    def __init__(self, fused: bool = False) -> None:
        self.fused = fused
        self.calls: list[tuple] = []  # ("compress" | "mm" | "search", shapes...) for tests

    @staticmethod
    def runs_on(device: torch.device) -> bool:
        return True

    @staticmethod
    def capability(device: torch.device) -> tuple[int, int]:
        return (9, 0)

    def compress(self, weight, mask, dtype, *, want_w: bool = True, want_t: bool = True) -> kernels.Sparse24:
        self.calls.append(("compress", tuple(weight.shape), want_w, want_t))
        fn = kernels.mask_and_compress if self.fused else kernels.mask_and_compress_reference
        return fn(weight, mask, dtype=dtype, want_w=want_w, want_t=want_t)

    @staticmethod
    def accepts(dense_b: torch.Tensor) -> bool:
        return _check_operand(dense_b)

    def mm(self, compressed, dense_b, bias, alg_id: int) -> torch.Tensor:
        k, n = dense_b.shape
        m = compressed.numel() * 16 // (9 * k)
        self.calls.append(("mm", m, k, n, alg_id))
        a = cslt_layout.decompress_reference(compressed, m, k).float()
        res = a @ dense_b.float()  # [m, n], float32 accumulation like the tensor cores
        if bias is not None:
            res = res + bias.float()[:, None]
        return res.t().to(dense_b.dtype).contiguous()

    def search(self, compressed, dense_b, bias) -> int:
        self.calls.append(("search", compressed.numel(), tuple(dense_b.shape)))
        return 3  # any id: the tests check it reaches mm


_DEFAULT: CsltOps | None = None


def default_ops() -> CsltOps:
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = CsltOps()
    return _DEFAULT
