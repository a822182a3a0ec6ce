"""The counter behind benchmarks/step_cost.py: every aten operator of a step, its FLOPs, the bytes
it reads and writes, and whether it would launch a kernel on CUDA. Counted, not timed.

    with StepCounter(device="meta") as c:      # or "cpu": real tensors, the same rules
        step()
    c.totals()   # {"flops", "bytes", "launches", "syncs", "by_class": {class: bytes}}

Rules (what a CUDA kernel of that operator moves, from its operand and result tensors):

- a view (`func.is_view`, detach, `_unsafe_view`, ...) and an allocation (`empty*`) cost
  nothing and launch nothing;
- an out-of-place operator reads each tensor argument once (the distinct elements of a view:
  a broadcast dimension, stride 0, is read once) and writes its results;
- an in-place operator reads and writes its storage (the mutated view) once, and reads its
  other arguments; `copy_` reads its source and writes its destination; a fill writes only;
- FLOPs are torch.utils.flop_counter's formulas (matmuls, attention), so the totals equal
  FlopCounterMode's; its table lacks the CPU flash attention, which is counted with the same
  formula as the CUDA one;
- `_foreach_*` and `_fused_*` (torch's fused AdamW) launch as CUDA's multi_tensor_apply does:
  a kernel per 320 chunks of 65,536 elements or per 36 tensors (depth 4), whichever fills first;
- a Triton kernel is one launch (see TritonRecorder); `_local_scalar_dense` (`.item()`) is a
  host synchronisation, no kernel.

On the meta device nothing runs: `.item()` answers 1.0 (False, 0), and CudaLike (a
TorchFunctionMode) makes the step dispatch as it would on CUDA where the meta device would
not: scaled_dot_product_attention runs as flash attention (CUDA's choice for bf16, causal, no
mask, head_dim <= 256; the meta device would take the math path and write the [seq, seq]
scores), and `autocast=True` emulates torch.autocast("cuda", bfloat16), which refuses the meta
device: matmul-class inputs cast to bf16 (each leaf parameter once per forward, as autocast's
cache does), autocast's float32 operators (log_softmax, softmax, pow, rsqrt, sum, mean, ...) cast
their bf16 inputs up. Both casts are made above autograd, as autocast makes them, so backward's
casts are autograd's own.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten

CLASSES = (
    "matmul/attention",
    "forward elementwise",
    "backward elementwise",
    "casts and copies",
    "fills",
    "optimizer",
    "gradient norm",
    "communication",
)
MATMUL = {
    "mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "convolution", "convolution_backward",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
    "_flash_attention_forward", "_flash_attention_backward", "_efficient_attention_forward",
    "_efficient_attention_backward", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward", "_sparse_semi_structured_mm",
    "_sparse_semi_structured_addmm", "_cslt_sparse_mm",
}  # fmt: skip
CPU_FLASH = {
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
}
COPIES = {"_to_copy", "copy_", "clone", "_copy_from", "_copy_from_and_resize", "contiguous", "index_copy_"}
FILLS = {
    "fill_", "zero_", "zeros", "ones", "full", "zeros_like", "ones_like", "full_like", "new_zeros",
    "new_ones", "new_full", "scalar_tensor", "fill", "zero", "arange",
}  # fmt: skip
FREE = {  # metadata only: no bytes, no kernel
    "detach", "alias", "lift_fresh", "_unsafe_view", "_reshape_alias", "empty", "empty_like",
    "empty_strided", "new_empty", "new_empty_strided", "set_", "resize_", "_local_scalar_dense",
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
    "_has_compatible_shallow_copy_type",
    "record_stream", "_version", "is_nonzero", "_nested_tensor_from_mask_left_aligned", "prim_layout",
}  # fmt: skip
ALLOC = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
MULTIPLE = {  # CUDA kernels one call launches where it is more than one
    "_scaled_dot_product_flash_attention_backward": 3,  # preprocess (dot(dO, O)), the main kernel, dq's cast
    "_flash_attention_backward": 3,
}
MTA_CHUNK, MTA_BLOCKS, MTA_TENSORS = 65536, 320, 36  # ATen MultiTensorApply.cuh, depth 4 (AdamW)


def mta_launches(numels: list[int], chunk: int = MTA_CHUNK, blocks: int = MTA_BLOCKS,
                 tensors: int = MTA_TENSORS) -> int:  # fmt: skip
    """Kernels CUDA's multi_tensor_apply launches over tensors of these sizes: it fills a launch
    with chunks until `blocks` chunks or `tensors` tensors are in it."""
    launches, held, used = 0, 0, 0
    for n in numels:
        if not n:
            continue
        held += 1
        chunks = -(-n // chunk)
        while chunks:
            take = min(chunks, blocks - used)
            used += take
            chunks -= take
            if used == blocks or (held == tensors and not chunks):
                launches += 1
                used = 0
                held = 1 if chunks else 0
    return launches + (1 if used else 0)


def unique_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements a view covers (a stride-0 dimension counts once)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size() if t.numel() else 0


def _fake_scalar(t: torch.Tensor):
    if t.dtype == torch.bool:
        return False
    return 1.0 if t.is_floating_point() else 0


class Op:
    __slots__ = ("name", "cls", "read", "write", "flops", "launches", "phase")

    def __init__(self, name, cls, read, write, flops, launches, phase):
        self.name, self.cls, self.read, self.write = name, cls, read, write
        self.flops, self.launches, self.phase = flops, launches, phase

    @property
    def bytes(self) -> int:
        return self.read + self.write


class StepCounter(TorchDispatchMode):
    """Records every operator (see the module docstring). `device`: only operators touching a
    tensor of this device are counted (meta: the host's own small work, the data loader's, is
    not a CUDA kernel); a host→device copy is. `region(name)`: operators inside are classed
    `name` ("optimizer", "gradient norm") whatever they are."""

    def __init__(self, device: str = "cpu"):
        super().__init__()
        self.device = torch.device(device)
        self.ops: list[Op] = []
        self.syncs = 0
        self._region: str | None = None
        # outputs of empty* (Triton's outputs), by id: a WeakSet compares two references to one
        # tensor with Tensor.__eq__ (elementwise), whose truth value is ambiguous
        self._fresh: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.recording = True

    # -- regions ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def region(self, name: str):
        old, self._region = self._region, name
        try:
            yield
        finally:
            self._region = old

    def wrap(self, fn, name: str):
        def run(*a, **k):
            with self.region(name):
                return fn(*a, **k)

        return run

    def clear(self) -> None:
        self.ops.clear()
        self.syncs = 0

    # -- the dispatch ----------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        flat = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if name == "_local_scalar_dense":
            if self.recording and any(t.device == self.device for t in flat):
                self.syncs += 1
            if flat and flat[0].device.type == "meta":
                return _fake_scalar(flat[0])
        out = func(*args, **kwargs)
        if name in ALLOC:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._fresh[id(t)] = t
        if self.recording:
            self._record(func, name, args, kwargs, flat, out)
        return out

    def _record(self, func, name, args, kwargs, flat, out) -> None:
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not any(t.device == self.device for t in flat + outs):
            return
        if func.is_view or name in FREE:
            return
        schema = func._schema
        comm = schema.name.startswith(("c10d::", "_c10d_functional::", "c10d_functional::"))
        written, read_only = [], []
        seen: set[int] = set()
        named = list(zip(schema.arguments, args)) + [
            (a, kwargs[a.name]) for a in schema.arguments if a.name in kwargs
        ]
        for arg, val in named:
            tensors = [t for t in tree_flatten(val)[0] if isinstance(t, torch.Tensor)]
            mutated = arg.alias_info is not None and arg.alias_info.is_write
            if mutated and name.startswith("_fused_adam") and arg.name == "grads":
                mutated = kwargs.get("grad_scale") is not None  # the kernel stores them only then
            for t in tensors:
                if id(t) in seen:
                    continue
                seen.add(id(t))
                if mutated:
                    written.append((t, not (arg.kwarg_only or arg.name.startswith("out"))))
                else:
                    read_only.append(t)
        read = sum(unique_bytes(t) for t in read_only)
        write = 0
        fill = name in FILLS
        for t, in_place in written:
            b = unique_bytes(t)
            write += b
            if in_place and not fill and name != "copy_":
                read += b  # an in-place operator reads its storage once and writes it once
        if not written:  # results are new tensors (an output aliasing an input is a view)
            ids = {id(t) for t in flat}
            write += sum(unique_bytes(t) for t in outs if id(t) not in ids)
        launches = 0
        cast = _reduction_cast(name, args, kwargs, self.device)
        if cast:  # ATen's reduction casts its input to the result's dtype first (a copy kernel)
            read, write, launches = read + cast[0], write + cast[1], 1
        flops = 0
        packet = func._overloadpacket
        if packet in flop_registry:
            flops = flop_registry[packet](*args, **kwargs, out_val=out)
        elif name in CPU_FLASH:
            flops = _cpu_flash_flops(name, args, out)
        if comm:
            launches += 1
        elif name.startswith(("_foreach_", "_fused_")):
            lists = [v for v in args if isinstance(v, (list, tuple)) and v and isinstance(v[0], torch.Tensor)]
            launches += mta_launches([t.numel() for t in lists[0]]) if lists else 1
        else:
            launches += MULTIPLE.get(name, 1)
        self.ops.append(Op(name, self._classify(name, comm), read, write, flops, launches, self._phase()))

    def _phase(self) -> str:
        return "backward" if torch._C._current_autograd_node() is not None else "forward"

    def _classify(self, name: str, comm: bool) -> str:
        if comm:
            return "communication"
        if self._region is not None:
            return self._region
        if name in MATMUL:
            return "matmul/attention"
        if name in FILLS:
            return "fills"
        if name in COPIES:
            return "casts and copies"
        return f"{self._phase()} elementwise"

    # -- Triton ----------------------------------------------------------------------------
    def triton(self, name: str, read: int, write: int, cls: str | None = None) -> None:
        """One Triton launch (recorded by TritonRecorder, or a modelled kernel)."""
        if self.recording:
            cls = self._region or cls or f"{self._phase()} elementwise"
            self.ops.append(Op(f"triton:{name}", cls, read, write, 0, 1, self._phase()))

    def is_fresh(self, t: torch.Tensor) -> bool:
        return self._fresh.get(id(t)) is t

    # -- results ---------------------------------------------------------------------------
    def totals(self) -> dict:
        by = dict.fromkeys(CLASSES, 0)
        launches = defaultdict(int)
        for op in self.ops:
            by[op.cls] = by.get(op.cls, 0) + op.bytes
            launches[op.cls] += op.launches
        return {
            "flops": sum(op.flops for op in self.ops),
            "bytes": sum(op.bytes for op in self.ops),
            "launches": sum(op.launches for op in self.ops),
            "syncs": self.syncs,
            "by_class": by,
            "launches_by_class": dict(launches),
        }

    def by_op(self) -> dict[str, dict]:
        """{operator: {"calls", "bytes", "launches"}}: where the bytes are."""
        out: dict[str, dict] = {}
        for op in self.ops:
            r = out.setdefault(op.name, {"calls": 0, "bytes": 0, "launches": 0, "flops": 0})
            r["calls"] += 1
            r["bytes"] += op.bytes
            r["launches"] += op.launches
            r["flops"] += op.flops
        return out


REDUCTIONS = {"sum", "mean", "linalg_vector_norm", "norm", "prod", "nansum"}


def _reduction_cast(name, args, kwargs, device) -> tuple[int, int] | None:
    """(read, write) of the copy a reduction with `dtype=` makes first: ATen's make_reduction
    casts the input to the result's dtype (ReduceOpsUtils.h), except bf16/fp16 -> fp32 on CUDA,
    which the kernel widens on the fly. Then the reduction reads the copy, not the input: the
    difference is added here."""
    dtype = kwargs.get("dtype")
    if name not in REDUCTIONS or dtype is None or not args or not isinstance(args[0], torch.Tensor):
        return None
    x = args[0]
    if x.dtype == dtype or (device.type in ("meta", "cuda") and x.dtype in LOW and dtype == torch.float32):
        return None
    n, out = unique_bytes(x) // x.element_size(), torch.empty((), dtype=dtype).element_size()
    return n * out, n * out  # the copy reads x and writes n * out; the reduction reads that, not x


def _cpu_flash_flops(name, args, out) -> int:
    q, k, v = args[:3] if name.endswith("cpu") else args[1:4]
    if name.endswith("cpu"):
        return sdpa_flop_count(q.shape, k.shape, v.shape)
    return sdpa_backward_flop_count(args[0].shape, q.shape, k.shape, v.shape)


# ------------------------------------------------------------------------------ Triton launches
class TritonRecorder:
    """Inside, a Triton kernel launch (`kernel[grid](...)`) runs nothing and is recorded as one
    launch: it reads its tensor arguments, and writes those that were allocated (torch.empty*)
    for it (its outputs). For kernels that update in place, `models` gives (read, write) bytes
    from the arguments: {kernel name: fn(args, kwargs) -> (read, write)}."""

    def __init__(self, counter: StepCounter, models: dict | None = None):
        self.counter, self.models = counter, models or {}

    def __enter__(self):
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        # Kernels defined while TRITON_INTERPRET=1 was set (a test session that ran the
        # interpreter first) are InterpretedFunctions: record their launches the same way,
        # rather than let the interpreter read a meta tensor's (absent) data.
        self._saved = [(cls, cls.run) for cls in (JITFunction, InterpretedFunction)]
        rec = self

        def recorder(real):
            def run(fn, *args, grid=None, warmup=False, **kwargs):
                if warmup:
                    return real(fn, *args, grid=grid, warmup=warmup, **kwargs)
                name = getattr(fn, "__name__", None) or getattr(getattr(fn, "fn", None), "__name__", "?")
                rec.launch(name, fn, args, kwargs)

            return run

        for cls, real in self._saved:
            cls.run = recorder(real)
        return self

    def __exit__(self, *exc):
        for cls, real in self._saved:
            cls.run = real

    def launch(self, name, fn, args, kwargs) -> None:
        if name in self.models:
            read, write = self.models[name](fn, args, kwargs)
        else:
            read = write = 0
            seen = set()
            for t in args:
                if isinstance(t, torch.Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    if self.counter.is_fresh(t):
                        write += unique_bytes(t)
                    else:
                        read += unique_bytes(t)
        self.counter.triton(name, read, write)


def adamw_kernel_bytes(fn, args, kwargs) -> tuple[int, int]:
    """meshspeed.kernels.adamw's kernel: reads P, G, M, V (and the decay byte per 16 elements,
    the clip factor), writes P, M, V, the published OUT and, when it clips, G (the bucket keeps
    the product)."""
    names = fn.arg_names
    a = dict(zip(names, args))
    a.update(kwargs)
    n = int(a["n"])

    def b(key):
        return n * a[key].element_size()

    read = b("P") + b("G") + b("M") + b("V")
    write = b("P") + b("M") + b("V")
    if a.get("HAS_DECAY"):
        read += -(-n // 16)
    if a.get("HAS_COEF"):
        read += 4
        write += b("G")
    if a.get("HAS_OUT"):
        write += b("OUT")
    if a.get("HAS_SKIP"):
        read += 4
    return read, write


# ------------------------------------------------------------------------------ CUDA-like dispatch
LOWER = {F.linear, torch.matmul, torch.Tensor.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm,
         torch.Tensor.__matmul__}  # fmt: skip
UPPER = {F.log_softmax, F.softmax, F.cross_entropy, F.nll_loss, torch.pow, torch.Tensor.pow, torch.rsqrt,
         torch.Tensor.rsqrt, torch.sum, torch.Tensor.sum, torch.mean, torch.Tensor.mean, torch.exp,
         torch.Tensor.exp, torch.log, torch.Tensor.log, torch.cumsum, torch.Tensor.cumsum,
         torch.logsumexp, torch.Tensor.logsumexp, F.layer_norm}  # fmt: skip
LOW = (torch.bfloat16, torch.float16)


class CudaLike(TorchFunctionMode):
    """The step's dispatch as on CUDA where the meta device's would differ (module docstring)."""

    def __init__(self, flash: bool = True, autocast: bool = False):
        super().__init__()
        self.flash, self.autocast = flash, autocast
        self._cache: dict[int, torch.Tensor] = {}  # autocast's: leaf parameters, once per forward

    def forward_done(self) -> None:
        self._cache.clear()

    def _down(self, t):
        if not (isinstance(t, torch.Tensor) and t.dtype == torch.float32):
            return t
        leaf = t.is_leaf and t.requires_grad
        if leaf and id(t) in self._cache:
            return self._cache[id(t)]
        low = t.to(torch.bfloat16)
        if leaf:
            self._cache[id(t)] = low
        return low

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.flash and func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            if mask is None and q.shape[-1] <= 256 and not kwargs.get("enable_gqa"):
                if self.autocast:
                    q, k, v = (self._down(t) for t in (q, k, v))
                causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
                scale = kwargs.get("scale")
                return aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[0]
        if self.autocast and torch.is_grad_enabled():
            if func in LOWER:
                args = tuple(self._down(a) for a in args)
                kwargs = {k: self._down(v) for k, v in kwargs.items()}
            elif func in UPPER:
                args = tuple(a.float() if isinstance(a, torch.Tensor) and a.dtype in LOW else a for a in args)
        return func(*args, **kwargs)


# ------------------------------------------------------------------------------ 2:4 on CUDA
class MetaCsltOps:
    """meshspeed.sparse.cslt_ops's contract on the meta device, counted as on an sm90 GPU with
    cuSPARSELt: `compress` is the fused Triton kernel (one launch reading W and the mask, writing
    W~ and/or W~^T in cuSPARSELt's layout, 9/16 of the dense bytes each: the kept half plus its
    metadata), `mm` is torch._cslt_sparse_mm (one launch reading W~, the dense operand and the
    bias, writing the result; half the dense product's FLOPs: the pruned half is skipped)."""

    name = "cusparselt (counted)"

    def __init__(self, counter: StepCounter):
        self.counter = counter

    @staticmethod
    def runs_on(device: torch.device) -> bool:
        return True

    @staticmethod
    def capability(device: torch.device) -> tuple[int, int]:
        return (9, 0)

    def compress(self, weight, mask, dtype, *, want_w: bool = True, want_t: bool = True):
        from meshspeed.sparse import kernels

        n = weight.numel() * 9 // 16
        elt = torch.empty((), dtype=dtype).element_size()
        w = torch.empty(n, dtype=dtype, device=weight.device) if want_w else None
        wt = torch.empty(n, dtype=dtype, device=weight.device) if want_t else None
        read = unique_bytes(weight) + weight.numel()  # W and the bool mask
        self.counter.triton("mask_and_compress", read, n * elt * (int(want_w) + int(want_t)))
        return kernels.Sparse24(w, wt, mask)

    @staticmethod
    def accepts(dense_b: torch.Tensor) -> bool:
        return dense_b.dim() == 2 and dense_b.shape[0] % 8 == 0 and dense_b.shape[1] % 8 == 0

    def mm(self, compressed, dense_b, bias, alg_id: int) -> torch.Tensor:
        k, n = dense_b.shape
        m = compressed.numel() * 16 // (9 * k)
        out = torch.empty((n, m), dtype=dense_b.dtype, device=dense_b.device)
        read = unique_bytes(compressed) + unique_bytes(dense_b)
        read += unique_bytes(bias) if bias is not None else 0
        c = self.counter
        if c.recording:
            op = Op("_cslt_sparse_mm", c._region or "matmul/attention", read, unique_bytes(out), m * k * n, 1,
                    c._phase())  # fmt: skip
            c.ops.append(op)
        return out

    @staticmethod
    def search(compressed, dense_b, bias) -> int:
        return 0
