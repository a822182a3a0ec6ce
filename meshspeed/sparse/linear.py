"""SparseLinear: a linear layer whose weight is multiplied by a mask, trained with a straight-through
estimator (STE) and optional SR-STE decay.

The dense weight stays a Parameter named `weight` (FQNs, optimizers and checkpoints keep working);
the mask is a bool buffer `mask` saved with the model so dynamic masks survive a resume.

Gradients (W~ = W * mask, the weight the forward used):
    grad_x = grad_y @ W~                     (sparse kernel on W~^T when the mask is transposable)
    grad_W = grad_y^T @ x + lambda * (1 - mask) * W   (STE: dense gradient everywhere; SR-STE decay)
    grad_b = sum(grad_y)
The dense gradient at pruned positions is what RigL's growth criterion reads.

On cuSPARSELt each of y and grad_x runs sparse or dense-masked as `kernel_mode` says ('sparse':
every product that can; 'auto': as measured at the layer's first forward, choice.py; 'dense':
none); `kernel_choice` records the choice. The library default is 'sparse' (what the layer did
before the choice existed); the trainer's --sparsity.kernels defaults to 'auto'.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from meshspeed.sparse import choice as kernel_choice
from meshspeed.sparse import cslt_ops, cuda
from meshspeed.sparse.masks import is_nm
from meshspeed.sparse.transposable import is_transposable_nm


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype active for this device type, or None."""
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
        return None
    except RuntimeError:  # device type autocast does not know (meta, ...)
        return None
    except TypeError:  # pragma: no cover - torch < 2.4 has no device argument
        if device_type == "cuda" and torch.is_autocast_enabled():
            return torch.get_autocast_gpu_dtype()
        if device_type == "cpu" and torch.is_autocast_cpu_enabled():
            return torch.get_autocast_cpu_dtype()
        return None


def _no_autocast(device_type: str):
    """Autocast off for our explicit casts; a no-op where autocast is not on (or not supported)."""
    if autocast_dtype(device_type) is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def _refresh_after_load(module: SparseLinear, incompatible_keys) -> None:
    # load_state_dict copies into the mask buffer behind set_mask's back: refresh the cached state
    module._mask_changed()


class _Compressed:
    """Holder so autograd does not see the compressed tensors as Function inputs.

    Without `ops`, w / wt are operands F.linear takes (torch's semi-structured tensors, CUTLASS).
    With `ops` (cslt_ops contract) they are cuSPARSELt-compressed W~ / W~^T, multiplied by
    ops.mm with the searched algorithms; `wm` is the dense W~ the products left dense read."""

    __slots__ = ("w", "wt", "wm", "ops", "alg_fwd", "alg_dgrad")

    def __init__(self, w, wt, wm=None, ops=None, alg_fwd: int = 0, alg_dgrad: int = 0) -> None:
        self.w, self.wt, self.wm = w, wt, wm
        self.ops, self.alg_fwd, self.alg_dgrad = ops, alg_fwd, alg_dgrad


def _sparse_mm(kernels: _Compressed, compressed, rows: torch.Tensor, bias, alg: int):
    """rows [tokens, k] times compressed A [m, k]^T -> [tokens, m], or None when ops cannot take
    the operand (then the caller runs dense-masked). rows^T is a view: cuSPARSELt reads the
    transposed operand in place and writes the transposed result, so nothing is copied."""
    if not rows.is_contiguous():
        rows = rows.contiguous()  # only for unusual strides; activations and gradients are contiguous
    if not kernels.ops.accepts(rows.t()):
        return None
    return kernels.ops.mm(compressed, rows.t(), bias, alg)


def _dense_w(kernels: _Compressed | None, weight, mask, cdtype):
    return kernels.wm if kernels is not None and kernels.wm is not None else weight.to(cdtype) * mask


class SparseLinearFunction(torch.autograd.Function):
    """y = x @ (W * mask)^T + b with STE/SR-STE backward; matmuls on 2:4 kernels when given.

    `dtype` is the compute dtype (autocast's) or None to compute in the inputs' own dtypes.
    `kernels` is None (dense-masked path) or a _Compressed with W~ [out, in] and optionally W~^T.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, mask, lam: float, dtype, kernels):
        out_features = weight.shape[0]
        with _no_autocast(x.device.type):
            x2 = x.reshape(-1, x.shape[-1])  # [tokens, in]
            if dtype is not None:
                x2 = x2.to(dtype)
            cdtype = dtype or weight.dtype
            b = bias.to(cdtype) if bias is not None else None
            y = None
            if kernels is not None and kernels.w is not None:
                if kernels.ops is None:  # the semi-structured matmul wants a contiguous dense operand
                    y = F.linear(x2.contiguous(), kernels.w, b)
                else:
                    y = _sparse_mm(kernels, kernels.w, x2, b, kernels.alg_fwd)  # [tokens, out]
            if y is None:
                y = F.linear(x2, _dense_w(kernels, weight, mask, cdtype), b)
        ctx.save_for_backward(x2, weight, mask)
        ctx.lam, ctx.cdtype, ctx.kernels = lam, cdtype, kernels
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y.reshape(*x.shape[:-1], out_features)

    @staticmethod
    def backward(ctx, grad_y):
        x2, weight, mask = ctx.saved_tensors
        gx = gw = gb = None
        with _no_autocast(grad_y.device.type):
            g2 = grad_y.reshape(-1, weight.shape[0]).to(ctx.cdtype)  # [tokens, out]
            if ctx.needs_input_grad[0]:
                k = ctx.kernels
                if k is not None and k.wt is not None:
                    if k.ops is None:
                        gx = F.linear(g2.contiguous(), k.wt)  # g @ W~ via compressed W~^T [in, out]
                    else:
                        gx = _sparse_mm(k, k.wt, g2, None, k.alg_dgrad)  # [tokens, in]
                if gx is None:
                    gx = g2 @ _dense_w(k, weight, mask, ctx.cdtype)
                gx = gx.reshape(ctx.x_shape).to(ctx.x_dtype)
            if ctx.needs_input_grad[1]:
                gw = (g2.t() @ x2).to(weight.dtype)  # [out, in], STE: no mask applied
                if ctx.lam:
                    gw = gw + ctx.lam * (~mask) * weight
            if ctx.needs_input_grad[2]:
                gb = g2.sum(0).to(ctx.bias_dtype)
        return gx, gw, gb, None, None, None, None


class SparseLinear(nn.Module):
    """nn.Linear replacement with a mask buffer; see the module docstring for the math.

    `path` / `path_reason` report the matmul path of the latest forward (before any forward: the
    path predicted from the weight's device and dtype).
    """

    groups = 1  # one unstructured budget for the whole matrix (stacked experts use one per expert)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        nm: tuple[int, int] | None = (2, 4),
        transposable: bool = False,
        sr_ste_lambda: float = 0.0,
        use_sparse_kernels: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        ref = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_from(ref.weight, ref.bias, nm, transposable, sr_ste_lambda, use_sparse_kernels)

    def _init_from(self, weight, bias, nm, transposable, sr_ste_lambda, use_sparse_kernels) -> None:
        if weight.dim() != 2:
            raise ValueError(f"SparseLinear needs a 2-D weight [out, in], got shape {tuple(weight.shape)}")
        if transposable and nm != (2, 4):
            raise ValueError(
                f"transposable masks exist for 2:4 only, got pattern {nm}; set transposable=False"
            )
        self.out_features, self.in_features = weight.shape
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight)
        self.bias = None if bias is None else (bias if isinstance(bias, nn.Parameter) else nn.Parameter(bias))
        self.register_buffer("mask", torch.ones(weight.shape, dtype=torch.bool, device=weight.device))
        self.nm, self.transposable = nm, transposable
        self.sr_ste_lambda, self.use_sparse_kernels = float(sr_ste_lambda), use_sparse_kernels
        self.name = ""  # FQN, filled in by sparsify() so errors and reports can name the layer
        self.mask_version = 0
        self._all_kept = True  # mask is all ones: the layer runs dense
        self._compressed = cuda.CompressedWeight()
        self._decision: cuda.PathDecision | None = None
        self.kernel_mode = "sparse"  # auto | sparse | dense: where y and grad_x run (choice.py)
        self.kernel_choice: kernel_choice.KernelChoice | None = None  # the latest, for reports
        self.uses_per_step = 1  # forwards per optimizer step, which share one compression
        self.cslt_ops = None  # a cslt_ops stand-in used instead of cuSPARSELt, on any device (tests)
        self.register_load_state_dict_post_hook(_refresh_after_load)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs) -> SparseLinear:
        """Wrap an nn.Linear, reusing its Parameter objects (optimizers holding them keep working)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        kw = dict(nm=(2, 4), transposable=False, sr_ste_lambda=0.0, use_sparse_kernels=True)
        kw.update(kwargs)
        self._init_from(linear.weight, linear.bias, **kw)
        return self

    # ---- mask ---------------------------------------------------------------------------------
    def set_mask(self, mask: torch.Tensor, *, check: bool = True) -> None:
        """Install a new mask (bool, weight's shape). Checks the pattern unless check=False."""
        if mask.shape != self.weight.shape:
            raise ValueError(
                f"{self.name or 'SparseLinear'}: mask shape {tuple(mask.shape)} != weight shape "
                f"{tuple(self.weight.shape)}"
            )
        mask = mask.to(device=self.mask.device, dtype=torch.bool)
        all_kept = bool(mask.all())
        if check and not all_kept and self.nm is not None:
            ok = is_transposable_nm(mask, *self.nm) if self.transposable else is_nm(mask, *self.nm)
            if not ok:
                kind = "transposable " if self.transposable else ""
                raise ValueError(
                    f"{self.name or 'SparseLinear'}: mask is not {kind}{self.nm[0]}:{self.nm[1]} "
                    "(nor all ones)"
                )
        with torch.no_grad():
            self.mask.copy_(mask)
        self._mask_changed(all_kept)

    def _mask_changed(self, all_kept: bool | None = None) -> None:
        self.mask_version += 1
        self._all_kept = bool(self.mask.all()) if all_kept is None else all_kept
        self._compressed.clear()

    def masked_weight(self) -> torch.Tensor:
        """W * mask, detached (what the forward multiplies by)."""
        return self.weight.detach() * self.mask

    # ---- path ---------------------------------------------------------------------------------
    def decide(
        self, compute_dtype: torch.dtype | None = None, input_dtype: torch.dtype | None = None
    ) -> cuda.PathDecision:
        w, stand_in = self.weight, self.cslt_ops is not None
        return cuda.decide_path(
            nm=self.nm,
            transposable=self.transposable,
            enabled=not self._all_kept,
            use_kernels=self.use_sparse_kernels,
            device_type="cuda" if stand_in else w.device.type,
            capability=self.cslt_ops.capability(w.device) if stand_in else cuda.device_capability(w.device),
            dtype=compute_dtype or w.dtype,
            out_features=self.out_features,
            in_features=self.in_features,
            backend="cusparselt" if stand_in else cuda.sparse_backend(),
            input_dtype=input_dtype,
            plain_weight=type(w.data) is torch.Tensor,
        )

    @property
    def path(self) -> str:
        return (self._decision or self.decide()).path

    @property
    def path_reason(self) -> str:
        return (self._decision or self.decide()).reason

    # ---- forward ------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._all_kept:
            self._decision = cuda.PathDecision(
                cuda.DENSE, "layer dense: mask keeps every weight (warmup, dense finish, schedule or budget)"
            )
            return F.linear(x, self.weight, self.bias)
        ac_dtype = autocast_dtype(x.device.type)
        decision = self.decide(ac_dtype, None if ac_dtype is not None else x.dtype)
        kernels = None
        if decision.path in (cuda.SPARSE, cuda.SPARSE_FWD):
            cdtype = ac_dtype or self.weight.dtype
            ops = self.cslt_ops or (cslt_ops.default_ops() if cuda.sparse_backend() == "cusparselt" else None)
            if ops is not None:
                decision, kernels = self._cslt(ops, decision, x.numel() // self.in_features, cdtype)
            elif self.kernel_mode == "dense":
                decision = cuda.PathDecision(cuda.DENSE_MASKED, "sparsity.kernels=dense")
            else:  # CUTLASS: torch's semi-structured tensors, both products sparse
                w, wt = self._compressed.get(
                    self.weight, self.mask, self.mask_version, cdtype, decision.path == cuda.SPARSE
                )
                kernels = _Compressed(w, wt)
        self._decision = decision
        return SparseLinearFunction.apply(
            x, self.weight, self.bias, self.mask, self.sr_ste_lambda, ac_dtype, kernels
        )

    def _cslt(self, ops, decision: cuda.PathDecision, tokens: int, cdtype: torch.dtype):
        """The measured (or forced) choice at this shape, and the operands it reads."""
        choice = kernel_choice.CHOOSER.get(
            ops,
            self.weight.detach(),
            self.mask,
            tokens=tokens,
            dtype=cdtype,
            bias=self.bias is not None,
            mode=self.kernel_mode,
            can_fwd=tokens % 8 == 0,  # cuSPARSELt's dense operand comes in rows of 8
            can_dgrad=decision.path == cuda.SPARSE,
            uses_per_step=self.uses_per_step,
        )
        self.kernel_choice = choice
        w, wt, wm = self._compressed.prepare(self.weight, self.mask, self.mask_version, cdtype, choice, ops)
        if choice.fwd and choice.dgrad:
            decision = cuda.PathDecision(cuda.SPARSE, "")
        elif choice.fwd:
            why = decision.reason or f"input gradient dense-masked: {choice.reason}"
            decision = cuda.PathDecision(cuda.SPARSE_FWD, why)
        elif choice.dgrad:
            decision = cuda.PathDecision(cuda.SPARSE_DGRAD, f"forward dense-masked: {choice.reason}")
        else:
            why = choice.reason if tokens % 8 == 0 else f"{tokens} tokens: cuSPARSELt needs a multiple of 8"
            decision = cuda.PathDecision(cuda.DENSE_MASKED, why)
        return decision, _Compressed(w, wt, wm, ops, choice.alg_fwd, choice.alg_dgrad)

    def extra_repr(self) -> str:
        pattern = "unstructured" if self.nm is None else f"{self.nm[0]}:{self.nm[1]}"
        t = ", transposable" if self.transposable else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, "
            f"pattern={pattern}{t}, sr_ste_lambda={self.sr_ste_lambda:g}"
        )
