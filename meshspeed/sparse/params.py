"""Masks on raw parameters that are not nn.Linear weights, e.g. stacked MoE experts [E, out, in].

Model code uses such a parameter directly (torch.bmm / grouped mm on `self.w1`), so there is no
module to swap. Instead a forward pre-hook puts the masked tensor W * mask (through the same STE /
SR-STE gradient as SparseLinear) into the module's instance __dict__ under the parameter's name.
Attribute lookup finds the instance __dict__ before nn.Module.__getattr__ reaches _parameters, so
`self.w1` inside forward is the masked tensor while the Parameter itself never moves: its FQN,
state_dict entry and optimizer reference stay as they were (unlike torch.nn.utils.parametrize,
which renames it to `parametrizations.w1.original`). A forward hook removes the entry afterwards.

Each expert gets its own mask: N:M groups run along the last dim inside one expert, and
unstructured budgets are split per expert (mask groups = E).
"""

from __future__ import annotations

import torch
from torch import nn

from meshspeed.sparse.masks import is_nm
from meshspeed.sparse.transposable import is_transposable_nm


class MaskedWeightSTE(torch.autograd.Function):
    """W * mask forward; backward grad_W = grad + lambda * (1 - mask) * W (STE + SR-STE decay)."""

    @staticmethod
    def forward(ctx, weight, mask, lam: float):
        ctx.save_for_backward(weight, mask)
        ctx.lam = lam
        return weight * mask

    @staticmethod
    def backward(ctx, grad):
        weight, mask = ctx.saved_tensors
        if ctx.lam:
            grad = grad + ctx.lam * (~mask) * weight
        return grad, None, None


REGISTRY_ATTR = "_meshspeed_sparse_params"


class SparseParam:
    """A mask attached to `module.<param_name>`; the mask is the buffer `<param_name>_mask`, or
    `mask_name` (e.g. "mask" on a linear-like module, the FQN a SparseLinear would give it)."""

    def __init__(
        self,
        module: nn.Module,
        param_name: str,
        *,
        nm: tuple[int, int] | None = (2, 4),
        transposable: bool = False,
        sr_ste_lambda: float = 0.0,
        name: str = "",
        mask_name: str | None = None,
    ) -> None:
        param = module._parameters.get(param_name)
        if not isinstance(param, nn.Parameter):
            raise ValueError(f"{name or param_name}: module has no parameter {param_name!r} to mask")
        if param.dim() < 2:
            raise ValueError(
                f"{name or param_name}: masking needs a weight with >= 2 dims, got shape {tuple(param.shape)}"
            )
        if transposable and nm != (2, 4):
            raise ValueError(f"{name or param_name}: transposable masks exist for 2:4 only, got pattern {nm}")
        self.module, self.param_name = module, param_name
        self.name = name or param_name
        self.nm, self.transposable, self.sr_ste_lambda = nm, transposable, float(sr_ste_lambda)
        self.mask_name = mask_name or f"{param_name}_mask"
        module.register_buffer(self.mask_name, torch.ones(param.shape, dtype=torch.bool, device=param.device))
        self.mask_version = 0
        self._all_kept = True
        self._handles = [
            module.register_forward_pre_hook(self._install),
            module.register_forward_hook(self._uninstall),
            module.register_load_state_dict_post_hook(self._after_load),
        ]
        registry = module.__dict__.setdefault(REGISTRY_ATTR, {})
        registry[param_name] = self

    # same surface as SparseLinear, so the controller treats both alike
    @property
    def weight(self) -> nn.Parameter:
        return self.module._parameters[self.param_name]

    @property
    def mask(self) -> torch.Tensor:
        return self.module._buffers[self.mask_name]

    @property
    def groups(self) -> int:
        """Mask groups with separate unstructured budgets: one per stacked expert."""
        return self.weight.shape[0] if self.weight.dim() > 2 else 1

    def set_mask(self, mask: torch.Tensor, *, check: bool = True) -> None:
        if mask.shape != self.weight.shape:
            raise ValueError(
                f"{self.name}: mask shape {tuple(mask.shape)} != weight shape {tuple(self.weight.shape)}"
            )
        mask = mask.to(device=self.mask.device, dtype=torch.bool)
        all_kept = bool(mask.all())
        if check and not all_kept and self.nm is not None:
            ok = is_transposable_nm(mask, *self.nm) if self.transposable else is_nm(mask, *self.nm)
            if not ok:
                raise ValueError(
                    f"{self.name}: mask is not {'transposable ' if self.transposable else ''}"
                    f"{self.nm[0]}:{self.nm[1]} per expert"
                )
        with torch.no_grad():
            self.mask.copy_(mask)
        self.mask_version += 1
        self._all_kept = all_kept

    def masked_weight(self) -> torch.Tensor:
        return self.weight.detach() * self.mask

    @property
    def path(self) -> str:
        return "dense" if self._all_kept else "dense-masked"

    @property
    def path_reason(self) -> str:
        if self._all_kept:
            return "layer dense: mask keeps every weight (warmup, dense finish, schedule or budget)"
        return "stacked expert weight: masked in a hook, grouped matmul is the model's"

    # ---- hooks --------------------------------------------------------------------------------
    def _install(self, module: nn.Module, args) -> None:
        if self._all_kept:
            module.__dict__.pop(self.param_name, None)
            return
        module.__dict__[self.param_name] = MaskedWeightSTE.apply(self.weight, self.mask, self.sr_ste_lambda)

    def _uninstall(self, module: nn.Module, args, output) -> None:
        module.__dict__.pop(self.param_name, None)

    def _after_load(self, module: nn.Module, incompatible_keys) -> None:
        self.mask_version += 1
        self._all_kept = bool(self.mask.all())

    def remove(self, *, bake: bool = True) -> None:
        """Detach the mask: with bake=True the Parameter keeps W * mask, else it keeps dense W."""
        for handle in self._handles:
            handle.remove()
        self.module.__dict__.pop(self.param_name, None)
        if bake:
            with torch.no_grad():
                self.weight.mul_(self.mask)
        del self.module._buffers[self.mask_name]
        registry = self.module.__dict__.get(REGISTRY_ATTR, {})
        registry.pop(self.param_name, None)
        if not registry:
            self.module.__dict__.pop(REGISTRY_ATTR, None)


def sparse_params_of(module: nn.Module) -> dict[str, SparseParam]:
    """The SparseParam objects attached to one module, by parameter name."""
    return module.__dict__.get(REGISTRY_ATTR, {})
