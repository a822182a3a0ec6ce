"""2:4 sparse tensor-core path: which layers can take it (and why not), and the compressed-weight cache.

Two backends. cuSPARSELt (where torch has it): torch's low-level ops (cslt_ops.py), the compressed
W~ and W~^T from one fused Triton kernel (kernels.py), the algorithm searched once per product
shape, and each product placed sparse or dense-masked by measurement (choice.py). CUTLASS (torch
builds without cuSPARSELt, or SparseSemiStructuredTensor._FORCE_CUTLASS): torch.sparse's
semi-structured tensor, as before. Both need CUDA sm80+, fp16/bf16, a 2-D plain weight whose rows
and columns are multiples of the backend's minimum tile.

The decision is a pure function of plain values (`decide_path`) so it is unit-tested on CPU; the
kernel-calling code is small and guarded, and runs only when the decision says so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

SPARSE = "sparse-2:4"  # forward and input-gradient matmuls on sparse tensor cores
SPARSE_FWD = (
    "sparse-2:4-fwd"  # forward sparse; input gradient dense-masked (mask not transposable / W^T misfit)
)
SPARSE_DGRAD = "sparse-2:4-dgrad"  # input gradient sparse; forward dense-masked (measured faster)
DENSE_MASKED = "dense-masked"  # F.linear on weight * mask: same math, dense kernels
DENSE = "dense"  # layer currently dense (warmup, dense finish, or not yet sparsified by the schedule)

_HALF = (torch.float16, torch.bfloat16)
# (sparse_min_rows, sparse_min_cols) for fp16/bf16 if torch's tables cannot be read.
_FALLBACK_TILES = {"cutlass": (32, 64), "cusparselt": (16, 16)}


class PathDecision(NamedTuple):
    path: str
    reason: str  # "" when the sparse path is taken in full


def sparse_backend() -> str:
    """'cusparselt' or 'cutlass': the backend our compression will use on this torch build."""
    try:
        from torch.sparse import SparseSemiStructuredTensor

        if SparseSemiStructuredTensor._FORCE_CUTLASS:
            return "cutlass"
    except ImportError:  # pragma: no cover - very old torch
        return "cutlass"
    cusparselt = getattr(torch.backends, "cusparselt", None)
    return "cusparselt" if cusparselt is not None and cusparselt.is_available() else "cutlass"


def min_tile(backend: str, dtype: torch.dtype) -> tuple[int, int]:
    """Minimum (rows, cols) multiple of the sparse operand for this backend and dtype."""
    try:
        from torch.sparse import SparseSemiStructuredTensorCUSPARSELT, SparseSemiStructuredTensorCUTLASS

        cls = (
            SparseSemiStructuredTensorCUSPARSELT
            if backend == "cusparselt"
            else SparseSemiStructuredTensorCUTLASS
        )
        cfg = cls._DTYPE_SHAPE_CONSTRAINTS[dtype]
        return int(cfg.sparse_min_rows), int(cfg.sparse_min_cols)
    except (ImportError, AttributeError, KeyError):
        return _FALLBACK_TILES.get(backend, (32, 64))


def _fit(rows: int, cols: int, tile: tuple[int, int], rows_name: str, cols_name: str) -> str:
    if rows % tile[0]:
        return f"{rows_name} {rows} not a multiple of {tile[0]}"
    if cols % tile[1]:
        return f"{cols_name} {cols} not a multiple of {tile[1]}"
    return ""


def decide_path(
    *,
    nm: tuple[int, int] | None,
    transposable: bool,
    enabled: bool,
    use_kernels: bool,
    device_type: str,
    capability: tuple[int, int] | None,
    dtype: torch.dtype,
    out_features: int,
    in_features: int,
    backend: str = "cutlass",
    input_dtype: torch.dtype | None = None,
    plain_weight: bool = True,
) -> PathDecision:
    """Which matmul path a sparse linear takes, and the reason when it is not the full sparse one.

    `dtype` is the compute dtype (the autocast dtype when autocast is on, else the weight's).
    """
    if not enabled:
        return PathDecision(
            DENSE, "layer dense: mask keeps every weight (warmup, dense finish, schedule or budget)"
        )
    if nm is None:
        return PathDecision(DENSE_MASKED, "unstructured pattern")
    if nm != (2, 4):
        return PathDecision(DENSE_MASKED, f"pattern {nm[0]}:{nm[1]} has no sparse kernel (only 2:4)")
    if not use_kernels:
        return PathDecision(DENSE_MASKED, "sparse kernels off (sparsity.use_sparse_kernels=false)")
    if device_type != "cuda":
        # the weight's device decides, not the machine: a CPU layer on a GPU host is not "no CUDA"
        return PathDecision(DENSE_MASKED, f"weight on {device_type}: 2:4 kernels need CUDA")
    if capability is None or tuple(capability) < (8, 0):
        return PathDecision(DENSE_MASKED, f"compute capability {capability} below sm80")
    if dtype not in _HALF:
        return PathDecision(DENSE_MASKED, f"dtype {str(dtype).replace('torch.', '')} not bf16/fp16")
    if input_dtype is not None and input_dtype != dtype:
        return PathDecision(
            DENSE_MASKED,
            f"input dtype {str(input_dtype).replace('torch.', '')} differs from compute dtype "
            f"{str(dtype).replace('torch.', '')}",
        )
    if not plain_weight:
        return PathDecision(DENSE_MASKED, "weight is a tensor subclass (e.g. DTensor), not a plain tensor")
    tile = min_tile(backend, dtype)
    # forward: compressed W [out, in]
    misfit = _fit(out_features, in_features, tile, "out_features", "in_features")
    if misfit:
        return PathDecision(DENSE_MASKED, misfit)
    if not transposable:
        return PathDecision(
            SPARSE_FWD, "input gradient dense-masked: mask not transposable (sparsity.transposable=false)"
        )
    # input gradient: compressed W^T [in, out]
    misfit = _fit(in_features, out_features, tile, "in_features", "out_features")
    if misfit:
        return PathDecision(SPARSE_FWD, f"input gradient dense-masked: W^T {misfit}")
    return PathDecision(SPARSE, "")


def default_compress(dense: torch.Tensor) -> torch.Tensor:
    """Compress a 2:4 [rows, cols] tensor for the backend sparse_backend() names."""
    from torch.sparse import SparseSemiStructuredTensorCUTLASS, to_sparse_semi_structured

    if sparse_backend() == "cutlass":
        # to_sparse_semi_structured picks cuSPARSELt unless _FORCE_CUTLASS is set, even where
        # cuSPARSELt is missing; call CUTLASS directly so such builds still work.
        return SparseSemiStructuredTensorCUTLASS.from_dense(dense)
    return to_sparse_semi_structured(dense)


class CompressedWeight:
    """Compressed masked weight (and its transpose), reused between optimizer steps.

    Gradient-accumulation micro-batches and repeated forwards between optimizer steps reuse
    one compression. The cache cannot see every write to the weight: data parallelism updates
    weights through views of its flat buckets, and such writes leave `weight._version` alone.
    So whoever updates the weights invalidates explicitly — the trainer calls
    `invalidate_compressed(model)` after every optimizer step. The key (weight storage and
    version, mask and its counter, dtype) still catches direct in-place writes and mask changes.
    """

    def __init__(self, compress: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.compress = compress or default_compress
        self.key: tuple | None = None
        self.w: torch.Tensor | None = None  # [out, in] compressed
        self.wt: torch.Tensor | None = None  # [in, out] compressed, or None
        self.wm: torch.Tensor | None = None  # [out, in] dense W * mask, for products left dense
        self.rebuilds = 0

    def get(
        self, weight: torch.Tensor, mask: torch.Tensor, mask_counter: int, dtype: torch.dtype, need_t: bool
    ):
        key = (
            weight.data_ptr(),
            weight._version,
            mask.data_ptr(),
            mask._version,
            mask_counter,
            dtype,
            need_t,
        )
        if key != self.key:
            with torch.no_grad():
                # [out, in]; +0.0 at pruned slots: w * mask writes -0.0 there for w < 0, which an
                # older cuSPARSELt counted as a kept value
                masked = torch.where(mask.bool(), weight.to(dtype), 0).contiguous()
                self.w = self.compress(masked)
                self.wt = self.compress(masked.t().contiguous()) if need_t else None
            self.key = key
            self.rebuilds += 1
        return self.w, self.wt

    def prepare(self, weight, mask, mask_counter: int, dtype: torch.dtype, choice, ops):
        """(compressed W~ or None, compressed W~^T or None, dense W~ or None) for a KernelChoice:
        what its sparse products read from `ops` and its dense ones read (the dense W~, built
        once per step instead of once per product). Same key and invalidation as `get`."""
        key = (
            weight.data_ptr(),
            weight._version,
            mask.data_ptr(),
            mask._version,
            mask_counter,
            dtype,
            choice.fwd,
            choice.dgrad,
            id(ops),
        )
        if key != self.key:
            self.clear()  # the old operands go before the new ones are made (peak memory)
            with torch.no_grad():
                if choice.any_sparse:
                    out = ops.compress(weight.detach(), mask, dtype, want_w=choice.fwd, want_t=choice.dgrad)
                    self.w, self.wt = out.w, out.wt
                if not (choice.fwd and choice.dgrad):
                    self.wm = weight.detach().to(dtype) * mask  # [out, in]
            self.key = key
            self.rebuilds += 1
        return self.w, self.wt, self.wm

    def clear(self) -> None:
        self.key = self.w = self.wt = self.wm = None


def invalidate_compressed(model: torch.nn.Module) -> int:
    """Drop every compressed weight cached in `model`'s modules (call after each optimizer
    step); returns how many caches were cleared."""
    n = 0
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, CompressedWeight):
                value.clear()
                n += 1
    return n


def device_capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(device))
