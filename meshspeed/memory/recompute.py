"""Recompute: trade backward compute for activation memory, exactly.

Modes nest, each keeping less than the one before (so counted bytes fall strictly
none > activation > selective > full):
- `activation`: in every SwiGLU feed-forward (a module whose w1/w2/w3 are modules: the dense
  FFN and the MoE shared expert; the routed experts are not touched) the product
  silu(w1 x) * (w3 x) is freed right after the down projection w2 consumes it and recomputed
  from w1 x and w3 x just before w2's backward (MindSpeed's activation-function recompute);
  silu's own output is never kept;
- `selective`: `activation` plus the attention core (repeat_kv, softmax and what feeds it) run
  under a checkpoint, keeping only q, k, v (Megatron's selective recompute);
- `full`: each chosen transformer block keeps only its input and is recomputed whole.
`layers` picks the first N blocks (None: all). The recompute replays the same operations on the
same inputs, so losses and gradients are bit-identical to the run without it.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .count import note_kept

RECOMPUTE_MODES = ("none", "activation", "selective", "full")


def _checkpointed(fn):
    """fn run under torch.utils.checkpoint (non-reentrant): only its inputs stay alive."""

    def run(*args, **kwargs):
        note_kept(a for a in args if isinstance(a, torch.Tensor))
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)

    run.recomputed = fn  # the wrapped function, for inspection / undo
    return run


def _swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.silu(a) * b


def _ffn_forward(self, x: torch.Tensor) -> torch.Tensor:
    """w2(silu(w1 x) * w3 x) keeping w1 x and w3 x but not the product ([..., hidden])."""
    a, b = self.w1(x), self.w3(x)
    note_kept((a, b))
    h = checkpoint(_swiglu, a, b, use_reentrant=False)  # keeps a, b; silu(a) is not saved
    out = self.w2(h)
    if not torch.is_grad_enabled() or not out.requires_grad:
        return out
    storage, nbytes = h.untyped_storage(), h.untyped_storage().nbytes()
    storage.resize_(0)  # w2 saved h for its weight gradient: its bytes come back in backward

    def restore(grad: torch.Tensor) -> None:
        # Runs when out's gradient is ready, i.e. before w2's backward unpacks h. A storage-level
        # copy leaves h's version counter alone (autograd would reject a modified saved tensor).
        with torch.no_grad():
            value = _swiglu(a, b)
        storage.resize_(nbytes)
        storage.copy_(value.untyped_storage())

    out.register_hook(restore)
    return out


def _is_swiglu(m: nn.Module) -> bool:
    # plain nn.Linear or its tensor-parallel replacements (modules); the routed experts hold
    # stacked Parameters instead and are left as they are
    return all(isinstance(getattr(m, n, None), nn.Module) for n in ("w1", "w2", "w3"))


def _blocks(model: nn.Module, layers_attr: str) -> list[nn.Module]:
    try:  # a dotted path too: a Hugging Face model's blocks are `model.layers`
        container = model.get_submodule(layers_attr)
    except AttributeError:
        return []
    return list(container.values() if isinstance(container, nn.ModuleDict) else container)


def apply_recompute(
    model: nn.Module, mode: str, layers: int | None = None, layers_attr: str = "layers"
) -> nn.Module:
    """Switch recompute on for the first `layers` blocks of `model` (the recipe's
    `pipeline.layers` container, `layers_attr`), in place. Works on tensor-parallel models and
    pipeline stages (a stage's blocks are its own first N)."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"memory.recompute={mode!r} is not a mode; use one of {', '.join(RECOMPUTE_MODES)}")
    if layers is not None and layers < 0:
        raise ValueError(
            f"memory.recompute_layers={layers} is negative; use 0 or more (or leave it unset: all)"
        )
    blocks = _blocks(model, layers_attr)
    if mode != "none" and not blocks:
        raise ValueError(f"memory.recompute={mode}: the model has no '{layers_attr}' blocks to recompute")
    for block in blocks[:layers]:
        if mode == "full":
            block.forward = _checkpointed(block.forward)
            continue
        for m in block.modules():
            if mode in ("activation", "selective") and _is_swiglu(m):
                m.forward = types.MethodType(_ffn_forward, m)
            if mode == "selective" and callable(getattr(m, "core", None)):
                m.core = _checkpointed(m.core)
    return model
